"""The backend contract over engine processes: what the in-process runtime uses with ``engine="process"``.

To the runtime this is a backend like any other (requests in, token steps out through each request's
``emit``); behind it, ``engines`` processes each load the real backend with its own cache, and every request
goes to one of them (:class:`~.routing.PrefixRouter`: the engine that holds its prefix, else the least
loaded). The runtime's work (templates, tokenizing, grammar compile check, detokenizing, stop strings, the
reasoning split, usage) stays in this process, so the engines' drivers share their Python with nothing.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...backends.base import Backend, BackendOptions, fail_all, gpu_share_options
from ...errors import EngineUnavailableError, ExLlamaIntegrationsError, MediaError
from .client import EngineProcess
from .decisions import score_on
from .routing import PrefixRouter

if TYPE_CHECKING:
    from concurrent.futures import Future

    from ...backends.base import BackendRequest
    from ...contract.decisions import LabelLogprobs, LabelScoring
    from ...model.directory import ModelDirectory


PLAN_WAIT = 1.0
"""Seconds an announced batch's spread holds for its members (then a request is routed on its own again)."""


@dataclass(frozen=True)
class EngineMedia:
    """A request's images, encoded and held by one engine (the request must go there)."""

    engine: int
    handle: str


def shared_options(options: BackendOptions, share: float) -> BackendOptions:
    """``options`` for one of several runtimes that load on the same GPUs at once, each with ``share`` of them.

    A backend that sizes its cache from the free memory (exllamav3's ``cache_size="auto"``) is told its share
    (:func:`~...backends.base.gpu_share_options`), unless the options name one: loaded at once, each would
    otherwise plan for all of it.
    """
    return options.model_copy(update=options.unless_given(options.model_fields_set, gpu_share_options(share)))


class EngineBackend(Backend):
    """``backend_cls`` loaded in ``engines`` processes of their own (see the module docstring)."""

    name = "engine"

    @classmethod
    def check_available(cls) -> None:
        """Checked for the backend it runs, before it starts."""

    @classmethod
    def check_model(cls, model: ModelDirectory) -> None:
        """Checked for the backend it runs, before it starts."""

    def __init__(  # noqa: D417 - not the backend constructor's arguments: it runs one
        self,
        backend_cls: type[Backend],
        model: ModelDirectory,
        options: BackendOptions,
        engines: int = 1,
        restart: bool = True,
    ) -> None:
        """Start ``engines`` engine processes (at once) and wait until each has loaded the model.

        Raises:
            ModelLoadError (and the rest of the load errors): as an engine raised it; none stays running.
        """
        self.name = backend_cls.name  # type: ignore[misc]
        options = shared_options(options, 1.0 / engines)
        self.unsupported_settings = backend_cls.unsupported_settings  # type: ignore[misc]
        self._lock = threading.Lock()
        self._router = PrefixRouter(engines)
        self._planned: deque[int] = deque()
        self._planned_until = 0.0
        slots: list[EngineProcess | BaseException | None] = [None] * engines

        def start(i: int) -> None:
            try:
                slots[i] = EngineProcess(model, backend_cls.name, options, index=i, restart=restart)
            except BaseException as e:  # noqa: BLE001 - raised below, after the others are closed
                slots[i] = e

        _in_parallel([functools.partial(start, i) for i in range(engines)])
        errors = [s for s in slots if isinstance(s, BaseException)]
        self.engines = [s for s in slots if isinstance(s, EngineProcess)]
        if errors:
            for e in self.engines:
                e.close()
            raise errors[0]
        ready = self.engines[0].ready
        self._context_length = int(ready["context_length"])
        self._max_batch = int(ready["max_batch_size"])
        self.vision = ready.get("vision")
        self._info = dict(ready.get("info") or {})

    @property
    def context_length(self) -> int:
        return self._context_length

    @property
    def max_batch_size(self) -> int:
        return self._max_batch * len(self.engines)

    def info(self) -> dict[str, Any]:
        gpu = sum(int(e.ready.get("gpu_bytes") or 0) for e in self.engines)
        return {
            **self._info,
            "engine": "process",
            "engines": len(self.engines),
            "engine_pids": self.pids(),
            "gpu_bytes": gpu,
        }

    def pids(self) -> list[int | None]:
        """Each engine's process id (None while one is not running)."""
        return [e.pid for e in self.engines]

    def health(self) -> str | None:
        problems = [e.problem for e in self.engines]
        if all(p is not None for p in problems):
            return "; ".join(p for p in problems if p is not None)
        return None

    def _choose(self, request: BackendRequest) -> int:
        if isinstance(request.embeddings, EngineMedia):
            return request.embeddings.engine
        with self._lock:
            if self._planned and time.monotonic() > self._planned_until:
                self._planned.clear()  # members of an announced batch that never came (failed before submit)
            if self._planned:
                return self._planned.popleft()
            loads = [e.load for e in self.engines]
            return self._router.choose(request.prompt_ids, loads, [e.problem is None for e in self.engines])

    def submit(self, requests: Sequence[BackendRequest]) -> None:
        groups: dict[int, list[BackendRequest]] = {}
        for request in requests:
            groups.setdefault(max(0, self._choose(request)), []).append(request)
        for i, group in groups.items():
            media = [r.embeddings.handle if isinstance(r.embeddings, EngineMedia) else None for r in group]
            try:
                self.engines[i].submit(group, media)
            except ExLlamaIntegrationsError as e:
                fail_all(group, e)

    def expect(self, n: int) -> None:
        """Plan where the next ``n`` requests go (spread by load) and tell each engine its share."""
        with self._lock:
            loads = [e.load for e in self.engines]
            usable = [e.problem is None for e in self.engines]
            if not any(usable):
                return
            share = [0] * len(self.engines)
            plan = []
            for _ in range(n):
                i = min((j for j, ok in enumerate(usable) if ok), key=lambda j: (loads[j] + share[j], j))
                share[i] += 1
                plan.append(i)
            self._planned = deque(plan)
            self._planned_until = time.monotonic() + PLAN_WAIT
        for i, k in enumerate(share):
            if k > 1:
                self.engines[i].expect(k)

    def encode_media(
        self, text: str, images: list[Any], add_special_tokens: bool, keys: Sequence[str]
    ) -> tuple[list[int], Any]:
        if self.vision is not None:
            raise MediaError(f"this model takes no images on backend {self.name!r}: {self.vision}; send text only.")
        with self._lock:
            usable = [i for i, e in enumerate(self.engines) if e.problem is None]
            if not usable:
                raise EngineUnavailableError(f"{self.health()}; retry in a moment.")
            i = min(usable, key=lambda j: (self.engines[j].load, j))
        ids, handle = self.engines[i].encode_media(text, images, add_special_tokens, keys)
        media = EngineMedia(i, handle)
        # let go of without a request (a /tokenize, a request refused before it ran): the engine drops them too
        weakref.finalize(media, self.engines[i].forget, handle)
        return ids, media

    def score_labels(self, job: LabelScoring) -> Future[LabelLogprobs]:
        """A decision's label scores, computed by the least loaded engine's backend (:mod:`.decisions`)."""
        with self._lock:
            usable = [i for i, e in enumerate(self.engines) if e.problem is None]
            i = min(usable, key=lambda j: (self.engines[j].load, j)) if usable else 0
        return score_on(self.engines[i], job)

    def close(self) -> None:
        _in_parallel([e.close for e in self.engines])

    def library_objects(self) -> dict[str, Any]:
        return {"engines": self.engines, "engine_pids": self.pids()}


def _in_parallel(calls: Sequence[Callable[[], object]]) -> None:
    """Run ``calls`` on threads of their own at once (engines load and close together), and wait for all."""
    threads = [threading.Thread(target=call, daemon=True) for call in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
