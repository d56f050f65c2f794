"""Shared runtimes: one loaded model per (resolved directory, resolved backend, resolved options); closed at exit.

Keys are taken after resolution, so ``backend="auto"`` and ``backend="transformers"`` on a CPU
machine, or ``device=None`` and ``device="cpu"``, share one load. Entries go away when their runtime
is closed or collected; a key's load lock exists only while someone is loading it.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

from ...backends import options_for, resolve_backend
from ...backends.base import gpu_share_options
from ...errors import InvalidSettingsError
from ...model.directory import ModelDirectory
from ...model.hub import resolve_model_dir

if TYPE_CHECKING:
    from ...backends.base import Backend, BackendOptions

T = TypeVar("T")
logger = logging.getLogger(__name__)
_open: weakref.WeakSet[Any] = weakref.WeakSet()


def close_at_exit(obj: Any) -> None:
    """Close ``obj`` at interpreter exit if it is still open (a backend thread killed inside torch aborts)."""
    _open.add(obj)


@atexit.register
def _close_all() -> None:
    for obj in list(_open):
        try:
            obj.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            logger.debug("closing %r at exit failed", obj, exc_info=True)


class Registry(Generic[T]):
    """Loaded objects by key, weakly held; one loader per key at a time, the others wait and reuse."""

    def __init__(self, is_alive: Callable[[T], bool]) -> None:
        self._is_alive = is_alive
        self._lock = threading.Lock()
        self._entries: dict[Hashable, weakref.ref[T]] = {}
        self._loading: dict[Hashable, tuple[threading.Lock, list[int]]] = {}

    def _get(self, key: Hashable) -> T | None:
        ref = self._entries.get(key)
        obj = ref() if ref is not None else None
        return obj if obj is not None and self._is_alive(obj) else None

    def get_or_load(self, key: Hashable, load: Callable[[], T]) -> T:
        """The live object for ``key``, loading it (once, whatever the number of callers) if there is none."""
        with self._lock:
            obj = self._get(key)
            if obj is not None:
                return obj
            key_lock, waiters = self._loading.setdefault(key, (threading.Lock(), [0]))
            waiters[0] += 1
        try:
            with key_lock:
                with self._lock:
                    obj = self._get(key)
                if obj is not None:
                    return obj
                obj = load()
                with self._lock:
                    self._entries[key] = weakref.ref(obj, functools.partial(self._drop, key))
                return obj
        finally:
            with self._lock:
                waiters[0] -= 1
                if waiters[0] == 0:
                    del self._loading[key]

    def _drop(self, key: Hashable, _ref: object = None) -> None:
        with self._lock:
            ref = self._entries.get(key)
            if ref is not None and ref() is None:
                del self._entries[key]

    def forget(self, key: Hashable, obj: T) -> None:
        """Remove ``obj``'s entry (on close)."""
        with self._lock:
            ref = self._entries.get(key)
            if ref is not None and ref() is obj:
                del self._entries[key]

    def live(self) -> list[T]:
        """Every live object."""
        with self._lock:
            return [o for o in (self._get(k) for k in list(self._entries)) if o is not None]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries) + len(self._loading)


class LoadPlan(NamedTuple):
    """A model's load resolved before anything loads: the inspected directory, the backend class, its options.

    Resolved once and handed down as it is (``ExLlamaRuntime(plan=...)``, the engine processes), never flattened to
    keyword arguments and resolved again.
    """

    model: ModelDirectory
    backend: type[Backend]
    options: BackendOptions


def plan_load(
    model_dir: str | os.PathLike[str],
    backend: str,
    max_seq_len: int | None,
    dtype: str | None,
    device: str | None,
    backend_options: Mapping[str, Any],
    plan: LoadPlan | None = None,
) -> LoadPlan:
    """The inspected directory, the backend class and its resolved options (nothing loaded yet).

    ``plan``: a load resolved already (a server's, :func:`plan_serving`), returned as it is.

    Raises:
        InvalidSettingsError: load options given beside a ``plan`` (its options are the plan's).
    """
    if plan is not None:
        if any(v is not None for v in (max_seq_len, dtype, device)) or backend_options:
            raise InvalidSettingsError("a runtime loaded from a plan takes the plan's load options, not others.")
        return plan
    model = ModelDirectory.inspect(resolve_model_dir(model_dir))
    backend_cls = resolve_backend(backend, model)
    values = {"max_seq_len": max_seq_len, "dtype": dtype, "device": device, **backend_options}
    return LoadPlan(model, backend_cls, options_for(backend_cls, values))


SERVING_DEFAULTS: dict[str, Any] = {"warmup": True, "burst_window": 0.02}
"""Load options a server's model gets unless they are given (where its backend has them): exllamav3 warms up at
load, and its idle driver waits out the gaps of a burst of clients (see ``ExLlamaV3Options.burst_window``)."""


def serving_options(backend: type[Backend], options: Mapping[str, Any], gpu_share: float = 1.0) -> dict[str, Any]:
    """Load options for a server's model: the given ones, and :data:`SERVING_DEFAULTS` where they say nothing.

    A replica that has ``gpu_share`` (< 1) of its GPU (a Ray replica's fractional ``num_gpus``) also gets that
    ``memory_share`` (:func:`~...backends.base.gpu_share_options`, as an engine of ``engines=N`` does).
    """
    out = {k: v for k, v in options.items() if v is not None}
    return {**out, **backend.Options.unless_given(out, {**SERVING_DEFAULTS, **gpu_share_options(gpu_share)})}


def plan_serving(
    model_dir: str | os.PathLike[str],
    backend: str,
    options: Mapping[str, Any],
    gpu_share: float = 1.0,
    model: ModelDirectory | None = None,
) -> LoadPlan:
    """A server's model planned (:func:`serving_options`); ``model``: the directory, where it was inspected already.

    Raises:
        ModelLoadError: the directory cannot be loaded.
        InvalidSettingsError: an unknown or invalid load option.
    """
    model = model or ModelDirectory.inspect(resolve_model_dir(model_dir))
    backend_cls = resolve_backend(backend, model)
    return LoadPlan(model, backend_cls, options_for(backend_cls, serving_options(backend_cls, options, gpu_share)))


def engine_choice(engine: str, engines: int) -> tuple[str, int]:
    """``engine`` and ``engines`` checked (``engines`` > 1 means engine processes)."""
    if engine not in ("thread", "process"):
        raise InvalidSettingsError(f"engine must be 'thread' or 'process', got {engine!r}.")
    if not isinstance(engines, int) or isinstance(engines, bool) or not 1 <= engines <= 64:
        raise InvalidSettingsError(f"engines must be an integer from 1 to 64, got {engines!r}.")
    return ("process" if engines > 1 else engine), engines
