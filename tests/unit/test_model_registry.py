"""The registry of a server of several models, its decisions isolated with a fake loader (milliseconds each).

Which model is unloaded to make room (the least recently used, idle, unpinned), that a model with a request in flight
never is, ``keep_alive`` (per model, per request, 0, negative), a load that fails (typed, nothing left counted, every
waiter told), one load for many waiters, loads off the event loop, and the refusals at start. The same behaviours run
end to end on real engine processes in ``tests/integration/test_multi_model.py``.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from exllama_integrations.errors import (
    InvalidModelError,
    InvalidSettingsError,
    ModelNotFoundError,
    ModelUnavailableError,
    UnsupportedTaskError,
)
from exllama_integrations.serve.registry.config import KINDS, ServerModels, model_spec
from exllama_integrations.serve.registry.footprint import Footprint
from exllama_integrations.serve.registry.kinds import Plan
from exllama_integrations.serve.registry.models import ModelRegistry

GIB = 2**30


class FakeRuntime:
    def __init__(self, name: str) -> None:
        self.name, self.closed = name, False

    def close(self) -> None:
        self.closed = True


class Loader:
    """Loads fake runtimes (recording where and how often), optionally slowly or failing."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.loads: list[str] = []
        self.threads: set[int] = set()
        self.fail: set[str] = set()
        self.runtimes: dict[str, FakeRuntime] = {}

    def plan(self, spec, model=None):
        return Plan(None, "fake", None, Footprint(0, spec.options.get("size", 1) * GIB), 128)

    def load(self, spec, plan):
        self.threads.add(threading.get_ident())
        time.sleep(self.delay)
        self.loads.append(spec.name)
        if spec.name in self.fail:
            raise InvalidModelError(f"{spec.name} is broken")
        rt = self.runtimes[spec.name] = FakeRuntime(spec.name)
        return rt


def registry(loader: Loader, *entries: dict, ram: int = 2, keep_alive: float = 300.0) -> ModelRegistry:
    specs = tuple(model_spec({"kind": "chat", **e}, f"models[{i}]") for i, e in enumerate(entries))
    config = ServerModels(specs, gpu_memory=0, ram=ram * GIB, keep_alive=keep_alive)
    return ModelRegistry(config, loaders={kind: (loader.plan, loader.load) for kind in KINDS})


def states(reg: ModelRegistry) -> dict[str, str]:
    return {e.name: e.state for e in reg.entries.values()}


async def use(reg: ModelRegistry, name: str, keep_alive: float | None = None) -> None:
    (await reg.acquire(name, keep_alive)).release()


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0.01)


async def test_the_least_recently_used_idle_unpinned_model_makes_room():
    loader = Loader()
    reg = registry(
        loader,
        {"name": "pinned", "model_dir": "p", "pinned": True},
        {"name": "b", "model_dir": "b"},
        {"name": "c", "model_dir": "c"},
        {"name": "d", "model_dir": "d"},
        ram=3,
    )
    await reg.start()
    assert states(reg) == {"pinned": "loaded", "b": "unloaded", "c": "unloaded", "d": "unloaded"}
    await use(reg, "b")
    await use(reg, "c")
    await use(reg, "b")  # c is now the least recently used
    await use(reg, "d")
    assert states(reg) == {"pinned": "loaded", "b": "loaded", "c": "unloaded", "d": "loaded"}
    assert loader.runtimes["c"].closed and not loader.runtimes["b"].closed
    await use(reg, "c")  # b is the least recently used now; the pinned model never goes
    assert states(reg) == {"pinned": "loaded", "b": "unloaded", "c": "loaded", "d": "loaded"}
    assert loader.loads == ["pinned", "b", "c", "d", "c"]
    await reg.close()
    assert all(rt.closed for rt in loader.runtimes.values())


async def test_a_model_with_a_request_in_flight_is_never_unloaded():
    loader = Loader()
    reg = registry(loader, {"name": "a", "model_dir": "a"}, {"name": "b", "model_dir": "b"}, ram=1)
    lease = await reg.acquire("a")
    with pytest.raises(ModelUnavailableError) as refused:
        await reg.acquire("b")
    assert refused.value.problem == "no_room" and type(refused.value).status == 503
    assert "'a' (loaded, serving 1 request(s)" in str(refused.value) and "budget" in str(refused.value)
    assert states(reg) == {"a": "loaded", "b": "unloaded"} and not loader.runtimes["a"].closed
    lease.release()
    await use(reg, "b")  # once its request ended, a makes room
    assert states(reg) == {"a": "unloaded", "b": "loaded"}
    await reg.close()


async def test_keep_alive_per_model_and_per_request():
    loader = Loader()
    reg = registry(
        loader,
        {"name": "short", "model_dir": "s", "keep_alive": "300ms"},
        {"name": "forever", "model_dir": "f", "keep_alive": -1},
        {"name": "default", "model_dir": "d"},
        ram=3,
        keep_alive=300,
    )
    await use(reg, "forever")
    await use(reg, "default", keep_alive=0)  # the request's own keep_alive wins: unloaded once it ended
    await settle()
    assert states(reg) == {"short": "unloaded", "forever": "loaded", "default": "unloaded"}
    await use(reg, "short")
    card = {c["id"]: c for c in reg.cards()}
    assert states(reg)["short"] == "loaded" and 0 < card["short"]["expires_in"] <= 0.3
    assert card["forever"]["expires_in"] is None and card["forever"]["keep_alive"] == -1
    await asyncio.sleep(0.6)
    assert states(reg) == {"short": "unloaded", "forever": "loaded", "default": "unloaded"}
    lease = await reg.acquire("short")  # loads again; its keep_alive waits for the request to end
    await asyncio.sleep(0.6)
    assert states(reg)["short"] == "loaded"
    lease.release()
    await asyncio.sleep(0.6)
    assert states(reg)["short"] == "unloaded"
    await reg.close()


async def test_a_failed_load_is_typed_leaves_nothing_and_is_tried_again():
    loader = Loader(delay=0.05)
    loader.fail.add("bad")
    reg = registry(loader, {"name": "bad", "model_dir": "x"}, {"name": "ok", "model_dir": "y"}, ram=1)
    results = await asyncio.gather(*(reg.acquire("bad") for _ in range(3)), return_exceptions=True)
    assert loader.loads == ["bad"], "one load for the three requests"
    for r in results:
        assert isinstance(r, ModelUnavailableError) and r.problem == "load_failed"
        assert "InvalidModelError: bad is broken" in str(r)
    entry = reg.entries["bad"]
    assert entry.state == "unloaded" and entry.leases == 0 and "bad is broken" in entry.error
    await use(reg, "ok")  # the failed model holds no memory: the other fits the whole budget
    loader.fail.clear()
    await use(reg, "bad")
    assert reg.entries["bad"].error is None
    await reg.close()


async def test_loads_run_off_the_event_loop_which_keeps_answering():
    loader = Loader(delay=0.3)
    reg = registry(loader, {"name": "slow", "model_dir": "s"})
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.ensure_future(tick())
    waiters = [reg.acquire("slow") for _ in range(4)]
    leases = await asyncio.gather(*waiters)
    ticker.cancel()
    assert ticks >= 10, "the event loop stood still during the load"
    assert threading.get_ident() not in loader.threads and loader.loads == ["slow"]
    assert reg.entries["slow"].leases == 4
    for lease in leases:
        lease.release()
    assert reg.entries["slow"].leases == 0
    await reg.close()


async def test_a_request_that_goes_away_while_its_model_loads_gives_its_lease_back():
    loader = Loader(delay=0.2)
    reg = registry(loader, {"name": "m", "model_dir": "m"}, keep_alive=0)
    task = asyncio.ensure_future(reg.acquire("m"))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.3)  # the load finishes for nobody, then keep_alive 0 unloads it
    await settle()
    assert reg.entries["m"].leases == 0 and states(reg) == {"m": "unloaded"}
    assert loader.runtimes["m"].closed
    await reg.close()


def test_refusals_before_anything_loads():
    loader = Loader()
    with pytest.raises(InvalidSettingsError, match="more than the whole budget"):
        registry(loader, {"name": "big", "model_dir": "b", "options": {"size": 3}}, ram=2)
    with pytest.raises(InvalidSettingsError, match="pinned models need"):
        registry(loader, *({"name": n, "model_dir": n, "pinned": True} for n in "abc"), ram=2)
    with pytest.raises(InvalidSettingsError, match="two models are named 'a'"):
        registry(loader, {"name": "a", "model_dir": "x"}, {"name": "a", "model_dir": "y"})
    reg = registry(loader, {"name": "a", "model_dir": "x"}, {"name": "e", "model_dir": "y", "kind": "embedding"})
    with pytest.raises(ModelNotFoundError, match="this server serves 'a', 'e'") as missing:
        reg.entry("nope")
    assert type(missing.value).status == 404
    assert reg.entry(None).name == "a", "a request that names no model gets the first"
    with pytest.raises(UnsupportedTaskError, match="serves chat models; 'e' is of kind 'embedding'") as wrong:
        reg.check_kind(reg.entry("e"), "/v1/chat/completions")  # the error a model alone raises when asked to chat
    assert type(wrong.value).status == 400 and "send it to /v1/embeddings" in str(wrong.value)
    assert loader.loads == []


def test_declared_memory_is_what_counts():
    loader = Loader()
    reg = registry(loader, {"name": "a", "model_dir": "x", "ram": "512MiB", "options": {"size": 1}})
    assert reg.entries["a"].held == Footprint(0, 512 * 2**20)


async def test_the_log_says_why_a_model_loads(caplog):
    """A pinned model's load is logged as loaded at startup, one loaded on demand as loaded for a request."""
    loader = Loader()
    reg = registry(loader, {"name": "p", "model_dir": "p", "pinned": True}, {"name": "b", "model_dir": "b"})
    with caplog.at_level("INFO", logger="exllama_integrations.serve"):
        await reg.start()
        started = caplog.text
        await use(reg, "b")
    assert "loading 'p' (fake) at startup (pinned)" in started and "for a request" not in started
    assert "loading 'b' (fake) for a request" in caplog.text
    await reg.close()
