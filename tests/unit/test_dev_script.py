"""`./dev test` runs what it is asked: the whole suite with the linters (CI), `--quick` the quick tier, and `PATH`
arguments only those paths (issue 54: it used to run the whole tests/ folder plus PATH). A stand-in .venv records
each command dev runs instead of running it."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def venv(tmp_path: Path) -> Path:
    """A .venv whose python, ruff, mypy and exllama-integrations write their arguments to a log, already set up."""
    log = tmp_path / "calls.log"
    (tmp_path / "bin").mkdir()
    for tool in ("python", "ruff", "mypy", "exllama-integrations"):
        script = tmp_path / "bin" / tool
        script.write_text(f'#!/bin/sh\necho "{tool} $*" >> {log}\n')
        script.chmod(0o755)
    stamp = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + (ROOT / ".ci" / "constraints.txt").read_bytes())
    (tmp_path / f".setup-test,bench-{stamp.hexdigest()[:16]}").touch()
    return tmp_path


def _dev(venv: Path, *args: str) -> list[str]:
    out = subprocess.run([str(ROOT / "dev"), "test", *args], env={**os.environ, "VENV": str(venv)}, timeout=60)
    assert out.returncode == 0
    return (venv / "calls.log").read_text().splitlines()


def test_ci_runs_the_linters_and_the_whole_suite(venv):
    calls = _dev(venv, "-q", "-p", "no:cacheprovider")
    assert calls[0].startswith("ruff check") and calls[1].startswith("mypy")
    assert calls[-1] == "python -m pytest -n 2 --dist loadscope tests -q -p no:cacheprovider"


def test_a_path_runs_only_that_path(venv):
    node = "tests/unit/test_wire.py::test_a_request_survives_the_wire"
    calls = _dev(venv, "tests/unit/test_greedy_bound.py", "-x", node)
    assert not any(c.startswith(("ruff", "mypy")) for c in calls)
    assert calls[-1] == f"python -m pytest -n 2 --dist loadscope tests/unit/test_greedy_bound.py {node} -x"


def test_quick_runs_the_quick_tier(venv):
    calls = _dev(venv, "--quick", "-q")
    assert calls[0].startswith("ruff check") and calls[1].startswith("mypy")
    assert calls[-1] == "python -m pytest -n 2 --dist loadscope tests -m quick and not gpu -q"
