"""Engine folders left by a server killed with SIGKILL are swept at the next engine start, and only those."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from exllama_integrations.runtime.engine import launch


def _folder(owner: str) -> Path:
    folder = Path(tempfile.mkdtemp(prefix=launch.FOLDER_PREFIX))
    (folder / launch.OWNER_FILE).write_text(owner)
    (folder / "requests").write_bytes(b"")  # where a socket file was
    return folder


def test_a_start_sweeps_the_folders_whose_owner_is_gone_and_no_other():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid now names no process
    parent = os.getppid()
    orphan = _folder(f"{gone.pid} ")
    reused = _folder(f"{parent} 1")  # the pid runs, but started at another time: another process took the pid
    live = _folder(f"{parent} {launch._started(parent)}")
    unnamed = Path(tempfile.mkdtemp(prefix=launch.FOLDER_PREFIX))  # another version's, or one being made now
    mine = None
    try:
        mine = Path(launch.private_folder())
        assert not orphan.exists() and not reused.exists()
        assert live.exists() and unnamed.exists()
        assert oct(mine.stat().st_mode & 0o777) == "0o700"
        assert (mine / launch.OWNER_FILE).read_text().split()[0] == str(os.getpid())
        assert launch.sweep_orphans() == []  # this process's own folder stays
    finally:
        for f in (orphan, reused, live, unnamed, mine):
            if f is not None:
                shutil.rmtree(f, ignore_errors=True)
