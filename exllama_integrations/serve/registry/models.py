"""Several models behind one server: a registry that loads each on its first request, within a memory budget.

Each model (a :class:`~.config.ModelSpec`) is ``unloaded``, ``loading``, ``loaded`` or ``unloading``; pinned
ones load when the server starts and stay. A request takes a :class:`Lease` on its model (:meth:`ModelRegistry.acquire`)
and gives it back when its response has ended: a model with a lease is never unloaded. A model that is not loaded
loads for the request that needs it (the request waits; the load's progress goes to the log), in a worker thread,
never on the event loop: the least recently used models that are loaded, unpinned and idle are unloaded first until
its memory (:mod:`.footprint`) fits the budget; if it cannot fit, the request gets
:class:`~exllama_integrations.errors.ModelUnavailableError` (503) saying what holds the memory. A load that fails
leaves nothing loaded and fails its requests with the same error, its cause in the message (and in ``/v1/models``).

``keep_alive`` has Ollama's meaning: how long after its last request a model stays loaded (the request's own, else
the model's, else the server's); 0 unloads it as soon as its last request has ended, a negative value never. Every
decision is taken on the event loop, so there are no locks; loads and unloads run in threads.

What each kind of model loads as, and which endpoints need which kind, is :mod:`.kinds`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from ...errors import (
    ExLlamaIntegrationsError,
    InvalidSettingsError,
    ModelNotFoundError,
    ModelUnavailableError,
    UnsupportedTaskError,
)
from ..metrics import Families
from .config import ModelSpec, ServerModels
from .entry import Entry, metrics_of
from .footprint import Footprint, default_budget, gib, measure
from .kinds import ENDPOINT_KINDS, KIND_OF_TASK, LOADERS, Loader, Plan, Planner, planned

logger = logging.getLogger("exllama_integrations.serve")

PROGRESS_EVERY = 10.0
"""Seconds between log lines while a model loads."""


class Lease:
    """A request's hold on its model (see the module docstring); :meth:`release` once its response has ended."""

    def __init__(self, registry: ModelRegistry, entry: Entry, keep_alive: float | None) -> None:
        self.registry, self.entry, self.keep_alive = registry, entry, keep_alive
        self.app = entry.app
        self.runtime = entry.runtime
        self._released = False

    def release(self) -> None:
        """Give the model back (idempotent); the last request to end starts its ``keep_alive``."""
        if not self._released:
            self._released = True
            self.registry._release(self.entry, self.keep_alive)


class ModelRegistry:
    """The models a server serves, loaded on demand within a budget (see the module docstring)."""

    def __init__(
        self,
        config: ServerModels,
        *,
        budget: Footprint | None = None,
        app_for: Callable[[Entry, Any], Any] | None = None,
        families: Families | None = None,
        loaders: Mapping[str, tuple[Planner, Loader]] | None = None,
    ) -> None:
        """Check every model (directory, backend, options, memory) before anything loads.

        ``app_for(entry, runtime)``: the HTTP app over a loaded model (its lease's ``app``).

        Raises:
            InvalidSettingsError: a kind without a loader, a model larger than the whole budget, pinned models that
                do not fit it together; and each model's own load errors (a missing directory ...).
        """
        self.config = config
        self.loaders = dict(loaders or LOADERS)
        if budget is None:
            found = default_budget() if config.gpu_memory is None or config.ram is None else Footprint()
            budget = Footprint(
                found.gpu if config.gpu_memory is None else config.gpu_memory,
                found.ram if config.ram is None else config.ram,
            )
        self.budget = budget
        self.families = families or Families()
        self.app_for = app_for
        self.entries: dict[str, Entry] = {}
        for spec in config.models:
            entry = Entry(*planned(spec, self.loaders))  # its kind found from its files where its entry says none
            if not entry.held.within(budget):
                raise InvalidSettingsError(
                    f"model {spec.name!r} needs about {entry.held.describe()}, more than the whole budget "
                    f"({budget.describe()}); raise the budget (gpu_memory, ram) or give the model less context."
                )
            entry.metrics = metrics_of(entry, self.families)
            self.entries[spec.name] = entry
        pinned = sum((e.held for e in self.entries.values() if e.spec.pinned), Footprint())
        if not pinned.within(budget):
            raise InvalidSettingsError(
                f"the pinned models need about {pinned.describe()} together, more than the budget "
                f"({budget.describe()})."
            )

    @classmethod
    def of_loaded(cls, *models: tuple[Any, str | None, Mapping[str, Any]], keep_open: bool = True) -> ModelRegistry:
        """A registry of models loaded already, each ``(runtime, name, entry)``, pinned.

        What ``create_app(runtime)`` serves, and Ray's ingress over its deployments.
        ``name``: the served name (None: the model's own); ``entry``: its other :class:`~.config.ModelSpec`
        keys (``chat_template``, ``tool_format``, ``model_dir``). Each kind is what its runtime says it does.
        ``keep_open``: the caller closes the runtimes (the registry never does).
        """
        specs, runtimes = [], {}
        for runtime, name, entry in models:
            info = runtime.model_info()
            kind = KIND_OF_TASK.get(str(info.details.get("task") or "generate"), "chat")
            keys = {"model_dir": info.name, **entry}
            spec = ModelSpec(name or info.name, kind=kind, pinned=True, **keys)
            specs.append(spec)
            runtimes[spec.name] = (runtime, Plan(None, info.backend, None, Footprint(), info.context_length))

        def plan(spec: ModelSpec, model: Any = None) -> Plan:
            return runtimes[spec.name][1]

        def load(spec: ModelSpec, plan: Plan) -> Any:
            return runtimes[spec.name][0]

        registry = cls(
            ServerModels(tuple(specs), gpu_memory=0, ram=0, keep_alive=-1.0),
            budget=Footprint(),
            loaders={kind: (plan, load) for kind in {s.kind or "chat" for s in specs}},
        )
        for e in registry.entries.values():
            e.keep_open = keep_open
        return registry

    def load_pinned_now(self) -> None:
        """Load the pinned models here, one after another, before a server's loop runs.

        ``serve`` does, so that a model that does not load stops it with its own typed error before it listens.

        Raises:
            the load's own errors (ModelLoadError, BackendUnavailableError ...).
        """
        for e in self.entries.values():
            if e.spec.pinned and e.state == "unloaded":
                runtime = self.loaders[e.kind][1](e.spec, e.plan)
                self._loaded(e, runtime, *self._served(e, runtime))

    def _served(self, e: Entry, runtime: Any) -> tuple[Any, Footprint | None]:
        """A loaded runtime's app and the memory it holds (closed again if either fails); off the event loop."""
        try:
            return (None if self.app_for is None else self.app_for(e, runtime)), _measured(runtime)
        except BaseException:
            if not e.keep_open:
                runtime.close()
            raise

    @staticmethod
    def _loaded(e: Entry, runtime: Any, app: Any, measured: Footprint | None) -> None:
        e.runtime, e.app, e.measured, e.error, e.state = runtime, app, measured, None, "loaded"
        e.last_used = time.monotonic()

    # ----------------------------------------------------------------- requests

    @property
    def default(self) -> str:
        """The model a request that names none gets (the first listed)."""
        return self.config.models[0].name

    def entry(self, name: str | None) -> Entry:
        """The entry of ``name`` (None: the default model; a loaded model also answers to its own name).

        Raises:
            ModelNotFoundError: (404) naming the models served.
        """
        e = self.entries.get(self.default if name is None else name)
        if e is None:
            e = next((x for x in self.entries.values() if x.answers_to(str(name))), None)
        if e is None:
            names = ", ".join(repr(n) for n in self.entries)
            missing = ModelNotFoundError(f"model {name!r} is not served here; this server serves {names}.")
            missing.param = "model"
            raise missing
        return e

    def check_kind(self, e: Entry, path: str) -> None:
        """Refuse a request for an endpoint that ``e``'s kind does not serve (before it loads).

        Raises:
            UnsupportedTaskError: (400) naming the endpoint, the model's kind and where to send it.
        """
        need = ENDPOINT_KINDS.get(path)
        if need is not None and need != e.kind:
            to = {"chat": "/v1/chat/completions", "embedding": "/v1/embeddings", "rerank": "/v1/rerank"}[e.kind]
            why = f"{path} serves {need} models; {e.name!r} is of kind {e.kind!r}: send it to {to}."
            raise UnsupportedTaskError(why)

    async def acquire(self, name: str | None, keep_alive: float | None = None) -> Lease:
        """A lease on the model, loading it first if it is not loaded (see the module docstring).

        Raises:
            ModelNotFoundError: (404) no such model.
            ModelUnavailableError: (503) no room for it within the budget now, or its load failed.
        """
        e = self.entry(name)
        e.leases += 1
        self._stop_timer(e)
        try:
            while e.state != "loaded":
                if e.busy is not None:
                    await asyncio.shield(e.busy)  # a load (its failure raises here) or an unload in progress
                    continue
                victims = self._room_for(e)
                e.state, e.busy = "loading", asyncio.get_running_loop().create_future()
                e.busy.add_done_callback(lambda f: f.cancelled() or f.exception())  # read, even with no waiter
                asyncio.get_running_loop().create_task(self._load(e, victims))
        except BaseException:
            self._release(e, None)
            raise
        e.last_used = time.monotonic()
        return Lease(self, e, keep_alive)

    def _room_for(self, e: Entry) -> list[Entry]:
        """The idle models to unload so that ``e`` fits, least recently used first (marked unloading now).

        Raises:
            ModelUnavailableError: it cannot fit while the others' requests run (or they are pinned).
        """
        need = e.held
        taken = [x for x in self.entries.values() if x.state != "unloaded" and x is not e]
        free = self.budget - sum((x.held for x in taken), Footprint())
        victims: list[Entry] = []
        idle = sorted((x for x in taken if x.state == "loaded" and not x.spec.pinned and x.leases == 0),
                      key=lambda x: x.last_used)  # fmt: skip
        for x in idle:
            if need.within(free):
                break
            victims.append(x)
            free = free + x.held
        if not need.within(free):
            held = ", ".join(
                f"{x.name!r} ({'pinned' if x.spec.pinned else x.state}"
                f"{f', serving {x.leases} request(s)' if x.leases else ''}, {x.held.describe()})"
                for x in taken
            )
            e.metrics.refuse("no_room")  # type: ignore[union-attr]
            raise ModelUnavailableError(
                f"model {e.name!r} needs about {need.describe()} to load, but the server's budget "
                f"({self.budget.describe()}) is held by models that cannot be unloaded now: {held}. Retry when their "
                "requests have ended, or raise the budget (--gpu-memory, --ram).",
                e.name,
                "no_room",
            )
        for x in victims:
            x.state = "unloading"
            x.busy = asyncio.get_running_loop().create_future()
        return victims

    async def _load(self, e: Entry, victims: list[Entry]) -> None:
        assert e.busy is not None
        loop = asyncio.get_running_loop()
        why = f"; unloading {', '.join(repr(v.name) for v in victims)} (least recently used) first" if victims else ""
        reason = "at startup (pinned)" if e.spec.pinned else "for a request"  # a pinned model loads only in start()
        logger.info("loading %r (%s) %s: about %s%s", e.name, e.plan.backend, reason, e.held.describe(), why)
        t0 = time.monotonic()

        async def progress() -> None:
            while True:
                await asyncio.sleep(PROGRESS_EVERY)
                logger.info("still loading %r: %.0f s, %d request(s) waiting", e.name, time.monotonic() - t0, e.leases)

        ticker = loop.create_task(progress())
        try:
            await asyncio.gather(*(self._unload(v, f"to make room for {e.name!r}") for v in victims))
            runtime = await asyncio.to_thread(self.loaders[e.kind][1], e.spec, e.plan)
            app, measured = await asyncio.to_thread(self._served, e, runtime)
        except BaseException as exc:  # noqa: BLE001 - every waiter gets it, typed; nothing stays loaded
            busy, e.busy = e.busy, None
            e.state, e.error = "unloaded", f"{type(exc).__name__}: {exc}"[:2000]
            logger.error("loading %r failed after %.1f s: %s", e.name, time.monotonic() - t0, e.error)
            e.metrics.refuse("load_failed")  # type: ignore[union-attr]
            failed = ModelUnavailableError(
                f"model {e.name!r} could not be loaded: {e.error}. The server's other models still serve; fix the "
                "model's entry or directory (its state and error are in /v1/models).",
                e.name,
                "load_failed",
            )
            self._done(busy, failed)
            return
        finally:
            ticker.cancel()
        self._loaded(e, runtime, app, measured)
        held = "" if e.measured is None else f": it holds {e.measured.describe()}"
        logger.info("loaded %r in %.1f s%s", e.name, time.monotonic() - t0, held)
        busy, e.busy = e.busy, None
        self._done(busy, None)
        if e.leases == 0:
            self._release(e, None, count=False)  # loaded for requests that all went away: its keep_alive starts

    @staticmethod
    def _done(busy: asyncio.Future[None] | None, error: BaseException | None) -> None:
        if busy is None or busy.done():
            return
        if error is None:
            busy.set_result(None)
        else:
            busy.set_exception(error)

    async def _unload(self, e: Entry, why: str) -> None:
        """Close a model (its state is ``unloading`` and it has no lease); in a thread."""
        runtime, e.runtime, e.app = (None if e.keep_open else e.runtime), None, None
        e.state, e.expires = "unloading", None
        if e.busy is None:
            e.busy = asyncio.get_running_loop().create_future()
        t0 = time.monotonic()
        try:
            if runtime is not None:
                await asyncio.to_thread(runtime.close)
        finally:
            e.state, e.measured = "unloaded", None
            if e.metrics is not None:
                e.metrics.cache_shape(0)
            busy, e.busy = e.busy, None
            self._done(busy, None)
            logger.info("unloaded %r %s (%.1f s)", e.name, why, time.monotonic() - t0)

    def _release(self, e: Entry, keep_alive: float | None, count: bool = True) -> None:
        if count:
            e.leases -= 1
            e.last_used = time.monotonic()
        if e.leases > 0 or e.state != "loaded" or e.spec.pinned:
            return
        keep = keep_alive if keep_alive is not None else e.spec.keep_alive
        keep = self.config.keep_alive if keep is None else keep
        if keep < 0:
            return
        loop = asyncio.get_running_loop()
        e.expires = time.monotonic() + keep
        e.timer = loop.call_later(keep, self._expire, e, keep)

    def _stop_timer(self, e: Entry) -> None:
        if e.timer is not None:
            e.timer.cancel()
        e.timer, e.expires = None, None

    def _expire(self, e: Entry, keep: float) -> None:
        e.timer = None
        if e.leases == 0 and e.state == "loaded" and not e.spec.pinned:
            e.state = "unloading"
            e.busy = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().create_task(self._unload(e, f"after {keep:g} s idle (keep_alive)"))

    # ----------------------------------------------------------------- life

    async def start(self) -> None:
        """Load the pinned models (one after another); a pinned model that does not load stops the server.

        Raises:
            ModelUnavailableError: a pinned model's load failed.
        """
        for e in self.entries.values():
            if e.spec.pinned:
                (await self.acquire(e.name)).release()

    async def close(self) -> None:
        """Unload every model (their requests end as cancelled)."""
        for e in self.entries.values():
            self._stop_timer(e)
        busy = [e.busy for e in self.entries.values() if e.busy is not None]
        await asyncio.gather(*(asyncio.shield(b) for b in busy), return_exceptions=True)
        loaded = [e for e in self.entries.values() if e.state == "loaded"]
        await asyncio.gather(*(self._unload(e, "as the server stops") for e in loaded))

    def cards(self) -> list[dict[str, Any]]:
        """Every model as ``/v1/models`` lists it: its state, kind, pinning, keep_alive and memory."""
        return [e.row(self.config.keep_alive) for e in self.entries.values()]


def _measured(runtime: Any) -> Footprint | None:
    """What a loaded runtime's engine processes hold (None for a runtime without engine processes)."""
    try:
        details = runtime.model_info().details
        pids = runtime.diagnostics().get("engine_pids") or []
    except (ExLlamaIntegrationsError, AttributeError):
        return None
    return measure(list(pids), int(details.get("gpu_bytes") or 0)) if pids else None


def budget_text(budget: Footprint) -> str:
    """The budget, for the start-up line."""
    return f"GPU {gib(budget.gpu)}, RAM {gib(budget.ram)}" if budget.gpu else f"RAM {gib(budget.ram)}"


__all__ = ["Entry", "Lease", "ModelRegistry"]
