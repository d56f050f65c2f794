"""The README's Python examples run as written on CPU (the README must not drift from the code)."""

import re
from pathlib import Path

README = (Path(__file__).parents[1] / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 6


def test_readme_python_blocks_run_in_order(demo_dir, capsys):
    namespace: dict = {}
    for i, block in enumerate(BLOCKS):
        try:
            exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)
        except Exception as e:  # pragma: no cover - the message is what matters
            raise AssertionError(f"README python block {i + 1} failed: {type(e).__name__}: {e}\n{block}") from e
    out = capsys.readouterr().out
    assert "Paris" in out
    assert "'name': 'add'" in out
