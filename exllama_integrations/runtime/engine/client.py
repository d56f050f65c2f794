"""One engine process seen from the runtime: started, spoken to over ZeroMQ, watched, and started again if it dies.

Channel: two ZeroMQ sockets over ``ipc://`` files in a private directory (mode 0700, removed with the engine,
and swept at the next start where a SIGKILL left it: :mod:`.launch`): PUSH for requests, PULL for steps. ZeroMQ
because it is made for this (vLLM's API server and engine core speak over it): framed messages, a queue per
direction, no partial reads to handle, and sends that never block a caller (``NOBLOCK``: an engine that cannot
take a message fails that request at once, typed).

The engine dying (killed, out of memory, a crash in a kernel) is seen by a thread waiting on the process:
every request it had ends with :class:`~exllama_integrations.errors.EngineUnavailableError` at once, the
runtime's :meth:`health` says why, and a new engine is started; requests that come meanwhile are refused with
the same error. An engine that stays alive but stops answering (stopped, a deadlock, a hung kernel) is seen
too: a watchdog pings it every ``PING_EVERY`` seconds (answered from its receive loop, with how long its driver
has gone without a step while holding requests); no answer for ``HUNG_AFTER`` seconds, or a driver without a
step for ``STALL_AFTER`` seconds, and the engine is declared hung: health says so, its requests end with
``EngineUnavailableError``, it is killed and replaced like one that died. Past ``MAX_RESTARTS`` starts in
``RESTART_WINDOW`` seconds, the next start waits (``BACKOFF_FIRST`` seconds, doubling to ``BACKOFF_MAX``) and
health says when; it never gives up while the runtime is open.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ...backends.base import fail_all, require
from ...errors import (
    EngineUnavailableError,
    ExLlamaIntegrationsError,
    InvalidSettingsError,
    ProtocolError,
    error_from_wire,
)
from ...model import grammar_worker
from .launch import exit_text, launch
from .wire import pack, receive, request_to_wire, step_from_wire

if TYPE_CHECKING:
    from ...backends.base import BackendOptions, BackendRequest
    from ...model.directory import ModelDirectory

logger = logging.getLogger(__name__)

MAX_RESTARTS = 5
"""Starts in ``RESTART_WINDOW`` seconds before the next one waits (back-off)."""
RESTART_WINDOW = 600.0
BACKOFF_FIRST = 5.0
"""Seconds the first start past ``MAX_RESTARTS`` waits; doubled for each one after, up to ``BACKOFF_MAX``."""
BACKOFF_MAX = 300.0
PING_EVERY = 1.0
"""Seconds between liveness pings to the engine."""
HUNG_AFTER = 10.0
"""Seconds without an answer to a ping after which the engine is declared hung and replaced."""
STALL_AFTER = 120.0
"""Seconds the engine's driver may go without a step while it holds requests (a long prefill is one step)."""
CLOSE_WAIT = 30.0
"""Seconds a closing engine has to end its requests and free the model before it is killed."""
MEDIA_WAIT = 120.0
"""Seconds an image encoding may take in the engine before the request fails."""


class _Call:
    """A reply the engine owes (an image encoding, a decision's label scores); ``on_done`` runs when it comes."""

    def __init__(self, on_done: Callable[[_Call], None] | None = None) -> None:
        self.done = threading.Event()
        self.reply: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.on_done = on_done

    def finish(self, reply: dict[str, Any] | None = None, error: BaseException | None = None) -> None:
        self.reply, self.error = reply, error
        self.done.set()
        if self.on_done is not None:
            self.on_done(self)


class EngineProcess:
    """One engine slot: its process (started again after a death), its channel and the requests it holds.

    Raises (on start):
        ModelLoadError and the rest of the load errors, as the engine raised them; EngineUnavailableError when
        the engine died while loading.
    """

    def __init__(
        self,
        model: ModelDirectory,
        backend: str,
        options: BackendOptions,
        *,
        index: int = 0,
        restart: bool = True,
        env: dict[str, str] | None = None,
    ) -> None:
        self.model, self.backend, self.options, self.index = model, backend, options, index
        self.restart = restart
        self.env = env or {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._open: dict[int, BackendRequest] = {}
        self._calls: dict[int, _Call] = {}
        self._next = 0
        self._closing = False
        self._restarts: list[float] = []
        self._stop = threading.Event()
        self._hung: str | None = None
        self._last_pong = time.monotonic()
        self._stalled = 0.0
        self._forgotten: deque[str] = deque()
        self.held_media = 0
        """Encoded images the engine holds for requests not yet submitted (as its last pong said)."""
        self.restarts = 0
        """Engines started again after one died or hung (in this slot's life)."""
        self.problem: str | None = None
        """Why this engine takes no requests now (None: it does)."""
        self.ready: dict[str, Any] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._start()

    # ----------------------------------------------------------------- life

    def _start(self) -> None:
        self._zmq = require("zmq", "engine", 'engine="process"')
        extra = {"grammar_seconds": grammar_worker.COMPILE_SECONDS}
        launched = launch(self._zmq, self.model, self.backend, self.options, self.env, extra)
        proc = launched.proc
        self._launched, self._proc, self._requests = launched, proc, launched.requests
        self.ready = launched.ready
        self.problem = None
        self._hung = None
        self._last_pong = time.monotonic()
        self._reader = threading.Thread(
            target=self._read, args=(proc, launched.steps), name="engine-reader", daemon=True
        )
        self._reader.start()
        threading.Thread(target=self._watch, args=(proc,), name="engine-watch", daemon=True).start()
        threading.Thread(target=self._ping, args=(proc,), name="engine-ping", daemon=True).start()
        logger.info("engine %d (pid %d) ready: %s on %s", self.index, proc.pid, self.model.name, self.backend)

    def _teardown(self, kill: bool) -> None:
        self._launched.teardown(kill)

    def _watch(self, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        if self._closing:
            return
        why = self._hung or f"the engine process (pid {proc.pid}) {exit_text(code)}"
        logger.error("%s; its requests end with EngineUnavailableError", why)
        with self._lock:
            self.problem = why + ("; it is starting again" if self.restart else "")
        self._reader.join(2.0)  # what it sent before it died is delivered first
        self._fail_open(why + " while generating; retry the request")
        self._teardown(kill=True)
        if self.restart:
            self._start_again(why)

    def _start_again(self, why: str) -> None:
        """Start a new engine, waiting out a back-off past ``MAX_RESTARTS`` starts in the window; never gives up."""
        while not self._closing:
            now = time.monotonic()
            self._restarts = [t for t in self._restarts if now - t < RESTART_WINDOW]
            over = len(self._restarts) - MAX_RESTARTS
            if over >= 0:
                delay = min(BACKOFF_MAX, BACKOFF_FIRST * 2**over)
                with self._lock:
                    self.problem = (
                        f"{why}; it was started again {len(self._restarts)} times in the last {RESTART_WINDOW:.0f} s, "
                        f"so the next start waits {delay:g} s (back-off)"
                    )
                logger.error("%s", self.problem)
                if self._stop.wait(delay):
                    return
            self._restarts.append(time.monotonic())
            self.restarts += 1
            try:
                self._start()
            except BaseException as e:  # noqa: BLE001 - reported by health and by every request; tried again
                logger.error("the engine could not start again: %s", e)
                why = f"{why}, and starting it again failed: {type(e).__name__}: {e}"[:2000]
                with self._lock:
                    self.problem = why + "; it is starting again"
                continue
            if self._closing:  # the runtime was closed while the new engine loaded: it must not outlive it
                self._teardown(kill=True)
            return

    def _ping(self, proc: subprocess.Popen[bytes]) -> None:
        """Ping the engine; one that does not answer in ``HUNG_AFTER`` s (or whose driver stalls) is replaced."""
        n = 0
        while not self._stop.wait(PING_EVERY):
            if self._closing or proc.poll() is not None or self._proc is not proc:
                return
            n += 1
            forget = []
            while self._forgotten:
                forget.append(self._forgotten.popleft())
            try:
                self._send({"op": "ping", "n": n, "forget": forget})
            except EngineUnavailableError:
                pass  # not answered: counted below
            quiet = time.monotonic() - self._last_pong
            stalled = self.stalled
            if quiet > HUNG_AFTER:
                why = f"the engine process (pid {proc.pid}) stopped answering ({quiet:.1f} s without a reply)"
            elif stalled > STALL_AFTER:
                why = f"the engine process (pid {proc.pid}) made no progress for {stalled:.0f} s with requests open"
            else:
                continue
            self._declare_hung(proc, why)
            return

    def _declare_hung(self, proc: subprocess.Popen[bytes], why: str) -> None:
        """Unhealthy at once, its requests ended typed, then killed (its watcher starts the next engine)."""
        logger.error("%s; it is replaced", why)
        with self._lock:
            self._hung = why
            self.problem = why + ("; it is being replaced" if self.restart else "")
        self._fail_open(why + "; retry the request")
        try:
            proc.kill()  # SIGKILL ends a stopped process too
        except OSError:
            pass

    def _fail_open(self, why: str) -> None:
        with self._lock:
            requests = list(self._open.values())
            self._open.clear()
            calls = list(self._calls.values())
            self._calls.clear()
        fail_all(requests, EngineUnavailableError(why + "."))
        for call in calls:
            call.finish(error=EngineUnavailableError(why + "."))

    def close(self) -> None:
        """Ask the engine to end its requests and free the model; kill it if it does not within ``CLOSE_WAIT``."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._stop.set()
        proc = self._proc
        if proc is not None and proc.poll() is None and self.problem is None:
            try:
                self._send({"op": "close"})
                proc.wait(CLOSE_WAIT)
            except (subprocess.TimeoutExpired, ExLlamaIntegrationsError):
                logger.warning("the engine (pid %d) did not close in %.0f s; killing it", proc.pid, CLOSE_WAIT)
        if hasattr(self, "_reader"):
            self._reader.join(2.0)
        self._fail_open("the runtime was closed")
        if proc is not None:
            self._teardown(kill=True)

    @property
    def pid(self) -> int | None:
        """The engine process's id (None while it is not running)."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    @property
    def load(self) -> int:
        """Requests (and replies: label scorings, image encodings) this engine holds."""
        return len(self._open) + len(self._calls)

    @property
    def stalled(self) -> float:
        """Seconds the engine's driver had gone without progress while holding requests, as its last pong said.

        A step, or a chunk of a long prefill, is progress; past ``STALL_AFTER`` the engine is declared hung.
        """
        return self._stalled if self.load else 0.0

    # ----------------------------------------------------------------- channel

    def _send(self, message: dict[str, Any], frames: Sequence[bytes] = ()) -> None:
        zmq = self._zmq
        try:
            frame = pack(message)
        except UnicodeEncodeError as e:
            raise InvalidSettingsError(
                f"a request holds text the engine channel cannot carry ({e.reason} at {e.object[e.start : e.end]!r}); "
                "send valid Unicode text (a lone surrogate is not a character)."
            ) from None
        with self._send_lock:
            try:
                self._requests.send_multipart([frame, *frames], flags=zmq.NOBLOCK, copy=False)
            except (zmq.ZMQError, AttributeError) as e:
                raise EngineUnavailableError(
                    f"the engine process cannot take requests ({self.problem or e}); retry in a moment."
                ) from None

    def _read(self, proc: subprocess.Popen[bytes], steps: Any) -> None:
        """Deliver steps to their requests and replies to their callers, until the engine is gone."""
        while True:
            if not steps.poll(50):
                if proc.poll() is not None or self._closing and self.load == 0:
                    return
                continue
            got = receive(steps, "the runtime")
            if got is None:
                continue
            message = got[0]
            op = message["op"]
            if op == "steps":
                self._deliver(message["steps"])
            elif op in ("media", "labels"):
                with self._lock:
                    call = self._calls.pop(int(message["call"]), None)
                if call is not None:
                    call.finish(message)
            elif op == "pong":
                self._last_pong = time.monotonic()
                self._stalled = float(message.get("stalled") or 0.0)
                self.held_media = int(message.get("media") or 0)
            elif op == "closed":
                return

    def _deliver(self, rows: list[Any]) -> None:
        for row in rows:
            rid, step = step_from_wire(row)
            with self._lock:
                request = self._open.get(rid)
                if request is not None and step.finish is not None:
                    del self._open[rid]
            if request is None:
                continue  # cancelled and already ended here, or an engine before a restart
            if request.steering is not None and step.token_ids:
                request.steering.observe(step.token_ids)  # its reasoning count, for usage
            request.emit(step)

    # ----------------------------------------------------------------- requests

    def submit(self, requests: Sequence[BackendRequest], media: Sequence[str | None]) -> None:
        """Hand requests to the engine (each with its image handle, or None); returns at once."""
        with self._lock:
            problem = self.problem if not self._closing else "the runtime was closed"
            if problem is None:
                rids = []
                for request in requests:
                    self._next += 1
                    self._open[self._next] = request
                    rids.append(self._next)
        if problem is not None:
            fail_all(requests, EngineUnavailableError(f"{problem}; retry in a moment."))
            return
        try:
            rows = [request_to_wire(rid, r, m) for rid, r, m in zip(rids, requests, media)]
            self._send({"op": "submit", "requests": rows})
        except Exception as e:  # noqa: BLE001 - nothing stays registered; each request ends typed
            with self._lock:
                for rid in rids:
                    self._open.pop(rid, None)
            if not isinstance(e, ExLlamaIntegrationsError):
                e = ProtocolError(f"a request could not be sent to the engine: {type(e).__name__}: {e}")
            fail_all(requests, e)
            return
        for rid, request in zip(rids, requests):
            request.cancel.on_set(self._canceller(rid))

    def _canceller(self, rid: int) -> Callable[[], None]:
        def cancel() -> None:
            if rid in self._open:
                try:
                    self._send({"op": "cancel", "rids": [rid]})
                except EngineUnavailableError:
                    pass  # a dead engine's requests are failed by its watcher

        return cancel

    def open_call(self, on_done: Callable[[_Call], None]) -> int | None:
        """A reply to wait for (its id; None: the engine takes nothing now, see :attr:`problem`)."""
        with self._lock:
            if self.problem is not None or self._closing:
                return None
            self._next += 1
            self._calls[self._next] = _Call(on_done)
            return self._next

    def drop_call(self, call_id: int) -> bool:
        """Stop waiting for a reply (False: it came, or failed, already)."""
        with self._lock:
            return self._calls.pop(call_id, None) is not None

    def forget(self, handle: str) -> None:
        """The engine may drop these encoded images (sent with the next ping; safe to call from a finalizer)."""
        self._forgotten.append(handle)

    def expect(self, n: int) -> None:
        """``n`` requests of one batch are on their way to this engine."""
        try:
            self._send({"op": "expect", "n": n})
        except EngineUnavailableError:
            pass

    def encode_media(
        self, text: str, images: list[Any], add_special_tokens: bool, keys: Sequence[str]
    ) -> tuple[list[int], str]:
        """A prompt with images, encoded in the engine: its ids and the handle its request names."""
        with self._lock:
            if self.problem is not None:
                raise EngineUnavailableError(f"{self.problem}; retry in a moment.")
            self._next += 1
            call_id = self._next
            call = self._calls[call_id] = _Call()
        shapes, frames = [], []
        for image in images:
            shapes.append([image.mode, image.width, image.height])
            frames.append(image.tobytes())
        message = {
            "op": "media",
            "call": call_id,
            "text": text,
            "images": shapes,
            "add_special_tokens": add_special_tokens,
            "keys": list(keys),
        }
        try:
            self._send(message, frames)
            if not call.done.wait(MEDIA_WAIT):
                raise EngineUnavailableError(f"the engine did not encode the images in {MEDIA_WAIT:.0f} s.")
        finally:
            with self._lock:
                self._calls.pop(call_id, None)
        if call.error is not None:
            raise call.error
        reply = call.reply or {}
        if reply.get("error") is not None:
            raise error_from_wire(reply["error"])
        return [int(t) for t in reply["ids"]], str(reply["handle"])
