"""The engine process: one backend and its driver in a process of their own, and nothing else in its Python.

Started by :class:`~.client.EngineProcess` as ``python -m exllama_integrations.runtime.engine.process``; its
first line of stdin is its configuration (model directory, backend, options, the two ZeroMQ addresses), and
stdin stays open for its life: when the parent goes away (killed, crashed), stdin ends and the engine exits
at once, so no engine outlives its server holding a GPU. Ctrl-C in a terminal reaches the whole process group;
the engine ignores it and is stopped by its parent, after the parent drained its streams.

Threads: the main thread reads requests (PULL) and hands them to the backend, and answers the runtime's
liveness pings at once (with how long the driver has gone without a step while it holds requests); the
backend's driver decodes; one thread encodes images and grammar threads compile grammars (so neither a slow
encoding nor a slow compile ever delays a ping: :mod:`~exllama_integrations.model.grammar_worker`); one sender
thread writes steps (PUSH), every step that came since its last send in one frame. The driver's only work for
the channel is appending a step to a list.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache, partial
from typing import TYPE_CHECKING, Any

from ...errors import ExLlamaIntegrationsError, MediaError
from .decisions import EngineScorer
from .wire import (
    error_wire,
    grammar_from_wire,
    pack,
    reasoning_from_wire,
    receive,
    settings_from_wire,
    step_to_wire,
)

if TYPE_CHECKING:
    from ...backends.base import Backend, BackendRequest, TokenStep
    from ...model.tokenizer import NativeTokenizer

logger = logging.getLogger("exllama_integrations.engine")

COALESCE = 0.0005
"""Seconds the sender waits after the first step of a burst, so the rest of the driver's step goes in the same frame
(the driver emits a step per request, one after another; a decode step takes milliseconds or more)."""

MEDIA_HELD = 64
"""Encoded images an engine keeps for requests not yet submitted (older ones are dropped)."""
GRAMMAR_WAITS = 8
"""Requests that wait for their grammar's compile at once, each on a thread (more wait their turn, within budget)."""


class Outbox:
    """Messages and steps for the runtime, sent by one thread in order, consecutive steps in one frame."""

    def __init__(self, socket: Any, backend: str) -> None:
        self._socket, self._backend = socket, backend
        self._cv = threading.Condition()
        self._items: deque[Any] = deque()
        self._closing = False
        self.last_step = time.monotonic()
        """When the driver last handed in a step (its progress, reported in every pong)."""
        self._thread = threading.Thread(target=self._run, name="engine-sender", daemon=True)
        self._thread.start()

    def step(self, rid: int, step: TokenStep) -> None:
        """A step for request ``rid`` (called on the driver: appends, wakes the sender if it sleeps, returns)."""
        with self._cv:
            if not self._items:
                self._cv.notify()
            self._items.append((rid, step))
            self.last_step = time.monotonic()

    def message(self, message: dict[str, Any], frames: tuple[bytes, ...] = ()) -> None:
        """A message, after every step already handed in."""
        with self._cv:
            self._items.append((message, frames))
            self._cv.notify()

    def close(self, timeout: float = 10.0) -> None:
        """Send what is waiting, then stop."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._items and not self._closing:
                    self._cv.wait()
                if not self._items:
                    return
            time.sleep(COALESCE)  # the rest of the driver's step arrives meanwhile: one frame, one wake-up of ours
            with self._cv:
                items = list(self._items)
                self._items.clear()
            rows: list[Any] = []
            for item in items:
                if isinstance(item[0], int):
                    rows.append(step_to_wire(item[0], item[1], self._backend))
                    continue
                if rows:
                    self._socket.send(pack({"op": "steps", "steps": rows}))
                    rows = []
                message, frames = item
                self._socket.send_multipart([pack(message), *frames])
            if rows:
                self._socket.send(pack({"op": "steps", "steps": rows}))


class Engine:
    """A loaded backend behind a channel: requests in, steps out."""

    def __init__(
        self,
        backend: Backend,
        tokenizer: NativeTokenizer,
        backend_name: str,
        out: Outbox,
        grammar_seconds: float | None = None,
    ) -> None:
        from ...model.grammar_worker import GrammarCompiler

        self.backend, self.tokenizer, self.name, self.out = backend, tokenizer, backend_name, out
        self._open: dict[int, BackendRequest] = {}
        self._lock = threading.Lock()
        self._grammars = GrammarCompiler(tokenizer, grammar_seconds)
        self._compiled = ThreadPoolExecutor(max_workers=GRAMMAR_WAITS, thread_name_prefix="engine-grammar")
        self._piece = lru_cache(maxsize=1 << 16)(self._token_text)
        self._media: OrderedDict[str, Any] = OrderedDict()
        self._since = time.monotonic()
        self._encodings: queue.SimpleQueue[tuple[dict[str, Any], list[bytes]] | None] = queue.SimpleQueue()
        self.scorer = EngineScorer(backend, out, backend_name)
        threading.Thread(target=self._encode_loop, name="engine-media", daemon=True).start()

    def stalled(self) -> float:
        """Seconds the driver has gone without a step (or progress within one) while it holds requests (0: none)."""
        with self._lock:
            if not self._open and not self.scorer.busy():
                return 0.0
            since = max(self._since, self.scorer.since)
        return max(0.0, time.monotonic() - max(since, self.out.last_step, self.backend.progress))

    def forget(self, handles: list[str]) -> None:
        """Drop encoded images no request will name (the runtime let go of them: a /tokenize, a failed request)."""
        with self._lock:
            for handle in handles:
                self._media.pop(str(handle), None)

    def held_media(self) -> int:
        """Encoded images held for requests not yet submitted."""
        with self._lock:
            return len(self._media)

    def encode_soon(self, message: dict[str, Any], frames: list[bytes]) -> None:
        """:meth:`encode_media` on the engine's image thread (the receive loop goes on answering pings)."""
        self._encodings.put((message, frames))

    def _encode_loop(self) -> None:
        while (job := self._encodings.get()) is not None:
            self.encode_media(*job)

    def _token_text(self, tid: int) -> str:
        return self.tokenizer.decode([tid], skip_special_tokens=False)

    def _emit(self, rid: int, request: BackendRequest, step: TokenStep) -> None:
        if step.finish is not None:
            with self._lock:
                self._open.pop(rid, None)
            if request.constraint is not None:
                step = dataclasses.replace(step, accepting=request.constraint.is_accepting())
        self.out.step(rid, step)

    def submit(self, rows: list[dict[str, Any]]) -> None:
        """Build the backend's requests from their wire form and start them together.

        A request whose grammar is not compiled yet starts once it is, from a thread of its own (the receive loop
        goes on answering pings), or ends typed when its compile is over the budget.
        """
        from ...backends.base import TokenStep

        requests = []
        for row in rows:
            rid = int(row["rid"])
            deadline = time.monotonic() + self._grammars.budget
            try:
                request = self._request(rid, row)
            except Exception as e:  # noqa: BLE001 - one bad request fails alone, typed
                self.out.step(rid, TokenStep(finish="error", error=e))
                continue
            with self._lock:
                if not self._open:
                    self._since = time.monotonic()  # the driver's clock starts with its first request
                self._open[rid] = request
            grammar = request.grammar
            if grammar is not None and not self._grammars.start(grammar).done():
                self._compiled.submit(self._start_constrained, rid, request, deadline)
                continue
            if grammar is not None and not self._constrain(rid, request, deadline):
                continue
            requests.append(request)
        if requests:
            self.backend.submit(requests)

    def _request(self, rid: int, row: dict[str, Any]) -> BackendRequest:
        from ...backends.base import BackendRequest
        from ..local.reasoning import ReasoningControl

        reasoning = reasoning_from_wire(row.get("reasoning"))
        control = None
        if reasoning is not None:
            control = ReasoningControl(reasoning, self._piece, row["reasoning_end_ids"])
        embeddings = None
        if row.get("media") is not None:
            with self._lock:
                embeddings = self._media.pop(row["media"], None)
            if embeddings is None:
                raise MediaError("the engine dropped the request's images before it ran; send it again.")
        request = BackendRequest(
            [int(t) for t in row["prompt_ids"]],
            settings_from_wire(row["settings"]),
            int(row["max_new_tokens"]),
            frozenset(int(t) for t in row["stop_token_ids"]),
            emit=lambda s: None,
            steering=control,
            embeddings=embeddings,
            grammar=grammar_from_wire(row.get("grammar")),
        )
        request.emit = partial(self._emit, rid, request)
        if row.get("cancelled"):
            request.cancel.set()
        return request

    def _constrain(self, rid: int, request: BackendRequest, deadline: float) -> bool:
        """Give ``request`` its grammar's matcher (waiting for the compile until ``deadline``); False: it ended."""
        from ...backends.base import TokenStep

        assert request.grammar is not None
        try:
            request.constraint = self._grammars.compile(request.grammar, deadline).matcher()
        except Exception as e:  # noqa: BLE001 - the request ends typed; the engine goes on
            with self._lock:
                self._open.pop(rid, None)
            self.out.step(rid, TokenStep(finish="error", error=e))
            return False
        return True

    def _start_constrained(self, rid: int, request: BackendRequest, deadline: float) -> None:
        """On a grammar thread: wait for the compile, then start the request (or end it typed)."""
        from ...backends.base import TokenStep

        if not self._constrain(rid, request, deadline):
            return
        try:
            self.backend.submit([request])
        except Exception as e:  # noqa: BLE001 - the backend closed meanwhile: the request ends typed
            with self._lock:
                self._open.pop(rid, None)
            self.out.step(rid, TokenStep(finish="error", error=e))

    def cancel(self, rids: list[int]) -> None:
        """Cancel requests by id (ones that already ended are ignored)."""
        with self._lock:
            found = [self._open.get(int(r)) for r in rids]
        for request in found:
            if request is not None:
                request.cancel.set()

    def encode_media(self, message: dict[str, Any], frames: list[bytes]) -> None:
        """Encode a prompt's images; answer with its ids and a handle the request will name."""
        call = message["call"]
        try:
            from PIL import Image

            shapes = message["images"]
            if len(shapes) != len(frames):
                raise MediaError(f"{len(shapes)} images announced, {len(frames)} sent.")
            images = [Image.frombytes(mode, (int(w), int(h)), data) for (mode, w, h), data in zip(shapes, frames)]
            ids, embeddings = self.backend.encode_media(
                message["text"], images, bool(message["add_special_tokens"]), list(message["keys"])
            )
        except Exception as e:  # noqa: BLE001 - answered typed; the engine goes on
            self.out.message({"op": "media", "call": call, "error": error_wire(e, self.name)})
            return
        handle = f"m{call}"
        with self._lock:
            self._media[handle] = embeddings
            while len(self._media) > MEDIA_HELD:
                self._media.popitem(last=False)
        self.out.message({"op": "media", "call": call, "ids": [int(t) for t in ids], "handle": handle})

    def close(self) -> None:
        """Close the backend (every open request gets its final step), then say so."""
        self._encodings.put(None)
        self._grammars.close()
        self._compiled.shutdown(wait=False, cancel_futures=True)
        self.backend.close()
        self.out.message({"op": "closed"})


def _gpu_bytes() -> int:
    """GPU memory this process's torch holds once loaded (its allocator's reservation, every device); 0 without CUDA."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return 0
    return int(sum(torch.cuda.memory_reserved(d) for d in range(torch.cuda.device_count())))


def _watch_parent() -> None:
    """Exit when stdin ends: the parent is gone, and nobody would read what this engine produces."""
    try:
        while sys.stdin.buffer.read(65536):
            pass
    except (OSError, ValueError):
        pass
    os._exit(0)


def serve(config: dict[str, Any]) -> int:
    """Load the backend, say ready (or why not), then serve requests until told to close."""
    import zmq

    from ...backends import backend_class, options_for
    from ...model.directory import ModelDirectory
    from ...model.tokenizer import NativeTokenizer

    context = zmq.Context()
    inbound = context.socket(zmq.PULL)
    inbound.setsockopt(zmq.LINGER, 0)
    inbound.connect(config["requests"])
    outbound = context.socket(zmq.PUSH)
    outbound.setsockopt(zmq.LINGER, 2000)
    outbound.connect(config["steps"])
    out = Outbox(outbound, str(config["backend"]))
    try:
        model = ModelDirectory.inspect(config["model_dir"])
        backend_cls = backend_class(config["backend"])
        options = options_for(backend_cls, config["options"])
        tokenizer = NativeTokenizer(model)
        backend = backend_cls(model, tokenizer, options)
    except BaseException as e:  # noqa: BLE001 - the parent raises it, typed
        logger.debug("the engine failed to load", exc_info=True)
        if not isinstance(e, ExLlamaIntegrationsError):
            from ...errors import ModelLoadError

            e = ModelLoadError(f"the engine process failed to load {config['model_dir']!r}: {type(e).__name__}: {e}")
        out.message({"op": "failed", "error": error_wire(e, str(config["backend"]))})
        out.close()
        return 1
    engine = Engine(backend, tokenizer, backend_cls.name, out, config.get("grammar_seconds"))
    gc.collect()
    gc.freeze()  # the model, torch and the libraries stay out of every later collection (a pause holds the GIL)
    out.message(
        {
            "op": "ready",
            "pid": os.getpid(),
            "context_length": backend.context_length,
            "max_batch_size": backend.max_batch_size,
            "vision": backend.vision,
            "info": json.loads(json.dumps(backend.info(), default=str)),
            "gpu_bytes": _gpu_bytes(),
        }
    )
    while True:
        got = receive(inbound, "the engine")
        if got is None:
            continue
        message, frames = got
        op = message["op"]
        if op == "submit":
            engine.submit(message["requests"])
        elif op == "cancel":
            engine.cancel(message["rids"])
        elif op == "expect":
            backend.expect(int(message["n"]))
        elif op == "media":
            engine.encode_soon(message, frames)
        elif op == "labels":
            engine.scorer.start(message)
        elif op == "cancel_labels":
            engine.scorer.cancel(message["calls"])
        elif op == "ping":
            engine.forget(message.get("forget") or [])
            out.message(
                {"op": "pong", "n": message.get("n"), "stalled": engine.stalled(), "media": engine.held_media()}
            )
        elif op == "close":
            engine.close()
            out.close()
            return 0


def main() -> None:
    """Entry point: read the configuration line, then serve; exits the process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    line = sys.stdin.buffer.readline()
    config = json.loads(line)
    logging.basicConfig(
        level=config.get("log_level", logging.WARNING),
        format=f"%(levelname)s engine[{os.getpid()}] %(message)s",
    )
    threading.Thread(target=_watch_parent, name="engine-parent", daemon=True).start()
    code = serve(config)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)  # the parent-watching thread sits in a read of stdin: no interpreter shutdown under it


if __name__ == "__main__":
    main()
