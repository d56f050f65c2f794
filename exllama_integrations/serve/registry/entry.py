"""One served model as a registry knows it: its entry, plan, state, leases and memory, its metrics and its card row.

An :class:`Entry` is what :class:`~.models.ModelRegistry` decides on (``unloaded``, ``loading``, ``loaded`` or
``unloading``; how many requests hold it; when it expires); :func:`metrics_of` is its series in the server's metric
families, read from the entry as it is at each scrape; :meth:`Entry.row` is its line in ``/v1/models``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from ..metrics import Families, Metrics
from .config import ModelSpec
from .footprint import Footprint
from .kinds import Plan


@dataclass(eq=False)
class Entry:
    """One served model and what the registry knows of it."""

    spec: ModelSpec
    plan: Plan
    metrics: Metrics | None = None
    state: str = "unloaded"
    runtime: Any = None
    app: Any = None
    leases: int = 0
    """Requests holding it: waiting for its load, or in flight."""
    last_used: float = 0.0
    measured: Footprint | None = None
    error: str | None = None
    """Why its last load failed (None once one succeeds)."""
    expires: float | None = None
    """When (``time.monotonic()``) it is unloaded for idleness, if no request comes first."""
    busy: asyncio.Future[None] | None = None
    """Its load or unload in progress."""
    timer: asyncio.TimerHandle | None = None
    keep_open: bool = False
    """Its runtime was handed in loaded (``create_app(runtime)``): the caller closes it, not the registry."""

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def kind(self) -> str:
        """What it serves (its entry's kind, or what its files say)."""
        return self.spec.kind or "chat"

    @property
    def held(self) -> Footprint:
        """The memory counted for it: its entry's own figures, else the larger of the estimate and the measurement."""
        counted = self.plan.estimate if self.measured is None else self.plan.estimate.larger(self.measured)
        return Footprint(
            counted.gpu if self.spec.gpu_memory is None else self.spec.gpu_memory,
            counted.ram if self.spec.ram is None else self.spec.ram,
        )

    def server_state(self) -> Any:
        """The loaded model's server state (its app's), or None."""
        return None if self.app is None else self.app.state.serve

    def answers_to(self, name: str) -> bool:
        """Whether a request's ``model`` names it: its served name, or (once loaded) the model's own name."""
        state = self.server_state()
        return name == self.name or (state is not None and name == state.info.name)

    def row(self, server_keep_alive: float) -> dict[str, Any]:
        """Its line in ``/v1/models``: its state, kind, pinning, keep_alive and memory."""
        keep = self.spec.keep_alive if self.spec.keep_alive is not None else server_keep_alive
        return {
            "id": self.name,
            "state": self.state,
            "pinned": self.spec.pinned,
            "kind": self.kind,
            "keep_alive": -1.0 if keep < 0 or self.spec.pinned else keep,
            "expires_in": None if self.expires is None else max(0.0, round(self.expires - time.monotonic(), 1)),
            "in_flight": self.leases,
            "backend": self.plan.backend,
            "context_length": self.plan.context_length,
            "memory": {
                "estimate": self.plan.estimate.as_dict(),
                "counted": self.held.as_dict(),
                "measured": None if self.measured is None else self.measured.as_dict(),
            },
            "error": self.error,
        }


def metrics_of(e: Entry, families: Families) -> Metrics:
    """The entry's series in ``families`` (labelled with its name), read from the entry at each scrape."""

    def healthy() -> int:
        if e.state != "loaded":
            return 0 if e.error else 1
        if e.runtime.closed:
            return 0
        check = getattr(e.runtime, "health", None)
        return 0 if callable(check) and check() is not None else 1

    def running() -> int:
        state = e.server_state()
        return 0 if state is None else min(int(state.running()), e.leases)

    def cache_use() -> tuple[int, int]:
        state = e.server_state()
        return (0, 0) if state is None else state.cache_use()  # type: ignore[no-any-return]

    def restarts() -> int:
        state = e.server_state()
        return 0 if state is None else state._restarts()  # type: ignore[no-any-return]

    return Metrics(
        e.name,
        lambda: e.leases,
        healthy,
        restarts,
        running=running,
        cache_use=cache_use,
        loaded=lambda: int(e.state == "loaded"),
        families=families,
    )


__all__ = ["Entry", "metrics_of"]
