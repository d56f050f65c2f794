"""Hardening, round 5 (issue 49, the server and engine half): no request kills the engine, admission counts work.

One engine-process runtime on the demo model and one server over it are shared by the tests of this module; the
engine's watchdog runs on test time (pings every 0.2 s, hung after 3 s) and its grammar budget is 1 s.
"""

from __future__ import annotations

import random
import string
import threading
import time

import httpx
import pytest

from exllama_integrations import ExLlamaRuntime, GenerationRequest, GenerationSettings

pytestmark = pytest.mark.slow

ENGINE_GRAMMAR_SECONDS = 1.0
HUNG_AFTER = 3.0


def greedy(n: int = 8, **kw) -> GenerationSettings:
    return GenerationSettings(max_new_tokens=n, temperature=0, **kw)


@pytest.fixture(scope="module")
def engine(demo_dir):
    """The demo model in an engine process (watchdog on test time, a 1 s grammar budget), and a server over it."""
    from servers import ThreadServer

    from exllama_integrations.model import grammar_worker
    from exllama_integrations.runtime.engine import client

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(client, "PING_EVERY", 0.2)
        mp.setattr(client, "HUNG_AFTER", HUNG_AFTER)
        with pytest.MonkeyPatch.context() as started:
            started.setattr(grammar_worker, "COMPILE_SECONDS", ENGINE_GRAMMAR_SECONDS)  # the engine's budget
            rt = ExLlamaRuntime(demo_dir, "transformers", engine="process")
        server = ThreadServer(rt)
        try:
            yield rt, server.url
        finally:
            server.stop()
            rt.close()


def alternatives(n: int) -> str:
    """A Lark grammar of ``n`` nine-letter alternatives (60 000: 840 KB, seconds to compile, growing faster than n)."""
    rng = random.Random(n)
    return "start: " + " | ".join('"' + "".join(rng.choices(string.ascii_lowercase, k=9)) + '"' for _ in range(n))


class Beside:
    """A long greedy stream read on a thread while the test does something else (closed by :meth:`survived`)."""

    def __init__(self, rt: ExLlamaRuntime) -> None:
        request = GenerationRequest(prompt="Story: once upon a time", settings=greedy(4000, ignore_eos=True))
        self.stream = rt.stream(request)
        self.error: BaseException | None = None
        self.tokens = 0
        self.first = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        assert self.first.wait(30)

    def _read(self) -> None:
        try:
            for chunk in self.stream:
                self.tokens += len(chunk.token_ids)
                self.first.set()
        except BaseException as e:  # noqa: BLE001 - what the reader sees is the point
            self.error = e
            self.first.set()

    def survived(self, more: int = 5) -> bool:
        """Whether the stream still runs unharmed (``more`` tokens after now, within 30 s); then it is closed."""
        now, t0 = self.tokens, time.perf_counter()
        while self.tokens < now + more and self.error is None and time.perf_counter() - t0 < 30:
            time.sleep(0.05)
        alive = self.error is None and self.tokens >= now + more
        self.stream.close()
        self.thread.join(10)
        return alive and self.error is None


# ------------------------------------------------------------------ defect 1: a grammar never kills the engine


def test_a_raw_grammar_over_the_size_bound_is_refused_at_the_door(engine):
    from exllama_integrations.contract.api import MAX_GRAMMAR_CHARS

    rt, url = engine
    source = alternatives(60_000)
    assert len(source) > MAX_GRAMMAR_CHARS
    t0 = time.perf_counter()
    reply = httpx.post(
        url + "/v1/completions",
        json={"prompt": "Pick:", "max_tokens": 4, "grammar": {"kind": "lark", "source": source}},
        timeout=60,
    )
    took = time.perf_counter() - t0
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "invalid_grammar" and error["param"] == "grammar"
    assert str(MAX_GRAMMAR_CHARS) in error["message"] and "MAX_GRAMMAR_CHARS" in error["message"]
    assert took < 5, took  # refused before anything compiles it (840 KB arrive and are parsed meanwhile)
    assert rt.active_requests == 0


def test_a_grammar_that_compiles_for_seconds_fails_typed_and_the_engine_serves_on(engine, monkeypatch):
    """Compiled off the loops that answer: the stream beside it goes on, the engine is not declared hung, 400s."""
    from exllama_integrations.contract import api
    from exllama_integrations.model import grammar_worker

    rt, url = engine
    (pid,) = rt.diagnostics()["engine_pids"]
    big = {"prompt": "Pick:", "max_tokens": 4, "grammar": {"kind": "lark", "source": alternatives(60_000)}}
    monkeypatch.setattr(api, "MAX_GRAMMAR_CHARS", 1_000_000)  # past the door: the time budgets hold it
    beside = Beside(rt)
    # this process's own budget first: refused at it (the compile goes on behind, and is kept)
    monkeypatch.setattr(grammar_worker, "COMPILE_SECONDS", 0.2)
    t0 = time.perf_counter()
    reply = httpx.post(url + "/v1/completions", json=big, timeout=60)
    assert reply.status_code == 400 and "within 0.2 s" in reply.json()["error"]["message"], reply.text
    assert reply.json()["error"]["code"] == "invalid_grammar"
    assert time.perf_counter() - t0 < 3
    # then past it: the engine compiles it (~6 s on one core, twice its hung limit) on a worker, within its 1 s
    monkeypatch.setattr(grammar_worker, "COMPILE_SECONDS", 120.0)
    t1 = time.perf_counter()
    reply = httpx.post(url + "/v1/completions", json=big, timeout=120)
    answered = time.perf_counter() - t1
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "invalid_grammar" and f"within {ENGINE_GRAMMAR_SECONDS:g} s" in error["message"]
    assert beside.survived()  # the stream beside it was never cut
    assert rt.diagnostics()["engine_pids"] == [pid] and rt.diagnostics()["engines"][0].restarts == 0
    assert httpx.get(url + "/health").json()["status"] == "ok"
    assert rt.generate("Hi", settings=greedy(2)).usage.completion_tokens == 2
    print(f"840 KB grammar: refused here in {t1 - t0:.2f} s, by the engine {answered:.1f} s later; engine kept")
