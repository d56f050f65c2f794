"""``python -m exllama_integrations.backends.exllamav3.fast --root DIR --version V`` (docs/exllamav3-releases.md's
check of a release) reads the source it is given, not a version string: an empty folder meets no requirement."""

from __future__ import annotations

import subprocess
import sys


def test_the_requirements_check_reads_the_source_it_is_given(tmp_path):
    cmd = [sys.executable, "-m", "exllama_integrations.backends.exllamav3.fast", "--root", str(tmp_path)]
    out = subprocess.run([*cmd, "--version", "1.6.5"], capture_output=True, text=True, timeout=120)
    said = out.stdout + out.stderr
    assert out.returncode == 0, said
    assert "every requirement met" not in said and ": missing" in said
