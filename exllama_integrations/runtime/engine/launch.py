"""Starting one engine process: its private folder, its two ZeroMQ sockets, the process and its handshake.

The folder (``exllama-engine-*`` in the temporary directory, mode 0700) holds the two ``ipc://`` socket files and
an ``owner`` file naming the process that made it (its pid and start time). It is removed when the engine is torn
down; a server killed with SIGKILL cannot remove it, so every start first sweeps the folders of this user whose
owner process is gone (:func:`sweep_orphans`), never one whose owner runs (or that names no owner).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import ModelLoadError, ProtocolError, error_from_wire
from .wire import unpack

if TYPE_CHECKING:
    from ...backends.base import BackendOptions
    from ...model.directory import ModelDirectory

logger = logging.getLogger(__name__)

FOLDER_PREFIX = "exllama-engine-"
"""The name every engine folder in the temporary directory starts with."""
OWNER_FILE = "owner"


def exit_text(code: int | None) -> str:
    """How a process ended, in words (``code``: its return code; None: it is still there but silent)."""
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _started(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, from ``/proc``; None where that cannot be read)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive (and not ours to judge)
    now = _started(pid)
    return started is None or now is None or now == started  # the same pid started later is another process


def sweep_orphans(folder: str | None = None) -> list[str]:
    """Remove the engine folders in ``folder`` (the temporary directory) of this user whose owner process is gone.

    Returns the names removed.
    """
    root = Path(folder or tempfile.gettempdir())
    removed = []
    try:
        entries = list(root.glob(FOLDER_PREFIX + "*"))
    except OSError:
        return []
    for entry in entries:
        try:
            if entry.is_symlink() or not entry.is_dir() or entry.stat().st_uid != os.getuid():
                continue
            pid_text, _, started = (entry / OWNER_FILE).read_text().partition(" ")
            pid = int(pid_text)
        except (OSError, ValueError):
            continue  # no owner named (another version's, or being made now): left alone
        if pid == os.getpid() or _alive(pid, started.strip() or None):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry.name)
    if removed:
        logger.info("removed %d engine folders whose server is gone: %s", len(removed), ", ".join(removed))
    return removed


def private_folder() -> str:
    """A new engine folder (mode 0700) that names this process as its owner."""
    sweep_orphans()
    folder = tempfile.mkdtemp(prefix=FOLDER_PREFIX)
    os.chmod(folder, 0o700)
    pid = os.getpid()
    Path(folder, OWNER_FILE).write_text(f"{pid} {_started(pid) or ''}")
    return folder


@dataclass
class Launched:
    """A started engine process and its channel: the process, its folder, the ZeroMQ context and sockets."""

    proc: subprocess.Popen[bytes]
    folder: str
    context: Any
    requests: Any
    """PUSH: requests to the engine."""
    steps: Any
    """PULL: steps and replies from the engine."""
    ready: dict[str, Any]
    """The engine's ``ready`` message (context length, batch size, vision, info)."""

    def teardown(self, kill: bool) -> None:
        """Kill the process (``kill``) or wait for it, close the channel, remove the folder."""
        proc = self.proc
        if kill and proc.poll() is None:
            proc.kill()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdin is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
        for sock in (self.requests, self.steps):
            sock.close(linger=0)
        self.context.term()
        shutil.rmtree(self.folder, ignore_errors=True)


def launch(
    zmq: Any, model: ModelDirectory, backend: str, options: BackendOptions, env: dict[str, str], extra: dict[str, Any]
) -> Launched:
    """Start an engine process for ``model`` and wait until it has loaded it (``extra``: more configuration).

    Raises:
        ModelLoadError (and the rest of the load errors): as the engine raised them; nothing stays running.
    """
    folder = private_folder()
    context = zmq.Context()
    requests = context.socket(zmq.PUSH)
    requests.setsockopt(zmq.LINGER, 0)
    requests.setsockopt(zmq.IMMEDIATE, 1)  # queue only to a connected engine; else a send fails at once
    steps = context.socket(zmq.PULL)
    steps.setsockopt(zmq.LINGER, 0)
    requests.bind(f"ipc://{folder}/requests")
    steps.bind(f"ipc://{folder}/steps")
    env = dict(os.environ, **env)
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", "exllama_integrations.runtime.engine.process"],
        stdin=subprocess.PIPE,
        env=env,
    )
    config = {
        "model_dir": str(model.path),
        "backend": backend,
        "options": options.model_dump(exclude_none=True),
        "requests": f"ipc://{folder}/requests",
        "steps": f"ipc://{folder}/steps",
        "log_level": logging.getLogger("exllama_integrations").getEffectiveLevel() or logging.WARNING,
        **extra,
    }
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(config).encode() + b"\n")
    proc.stdin.flush()
    launched = Launched(proc, folder, context, requests, steps, {})
    try:
        launched.ready = _handshake(proc, steps, model.name)
    except BaseException:
        launched.teardown(kill=True)
        raise
    return launched


def _handshake(proc: subprocess.Popen[bytes], steps: Any, name: str) -> dict[str, Any]:
    while True:
        if steps.poll(100):
            message = unpack(steps.recv_multipart()[0])
            if message["op"] == "ready":
                return message  # type: ignore[no-any-return]
            if message["op"] == "failed":
                raise error_from_wire(message.get("error"))
            raise ProtocolError(f"the engine said {message['op']!r} before it was ready.")
        code = proc.poll()
        if code is not None:
            raise ModelLoadError(
                f"the engine process for {name!r} {exit_text(code)} while loading (its log is above); nothing stays "
                "loaded."
            )
