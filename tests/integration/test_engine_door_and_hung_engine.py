"""An engine process's door and watchdog: one wire rule for text at the door, per-request budgets, a hung engine
seen, its requests ended typed and the engine replaced (issue 34, hardening round 4).

One engine-process runtime on the demo model and one server over it are shared by the tests of this module
(the hung-engine test runs last: it replaces the engine, then checks that the new one serves).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from exllama_integrations import (
    EngineUnavailableError,
    ExLlamaRuntime,
    GenerationRequest,
    GenerationSettings,
    InvalidSettingsError,
)

pytestmark = pytest.mark.slow


def greedy(n: int = 8, **kw) -> GenerationSettings:
    return GenerationSettings(max_new_tokens=n, temperature=0, **kw)


@pytest.fixture(scope="module")
def engine(demo_dir):
    """The demo model in an engine process whose watchdog runs on test time (pings every 0.2 s, hung after 4 s,
    a back-off from the first restart on)."""
    from servers import ThreadServer

    from exllama_integrations.runtime.engine import client

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(client, "PING_EVERY", 0.2)
        mp.setattr(client, "HUNG_AFTER", 4.0)
        mp.setattr(client, "MAX_RESTARTS", 0)
        mp.setattr(client, "BACKOFF_FIRST", 1.5)
        rt = ExLlamaRuntime(demo_dir, "transformers", engine="process")
        server = ThreadServer(rt)
        try:
            yield rt, server.url
        finally:
            server.stop()
            rt.close()


def post(url: str, path: str, body: bytes) -> httpx.Response:
    return httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=60)


# ------------------------------------------------------------------ item 5: one wire rule at the door


def test_a_lone_surrogate_is_refused_typed_and_leaves_nothing_registered(engine):
    rt, _ = engine
    with pytest.raises(InvalidSettingsError, match="surrogate"):
        rt.generate("Hi", settings=greedy(2, stop=["\ud800"]))
    with pytest.raises(InvalidSettingsError, match="surrogate"):
        rt.generate("Hi \udfff there", settings=greedy(2))
    assert rt.active_requests == 0
    assert [e.load for e in rt.diagnostics()["engines"]] == [0]
    assert rt.generate("Hi", settings=greedy(2)).text  # the engine goes on serving


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", rb'{"prompt": "Hi", "max_tokens": 2, "stop": ["\ud800"]}'),
        ("/v1/completions", rb'{"prompt": "Hi \udc00", "max_tokens": 2}'),
        ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "Hi \ud83d"}], "max_tokens": 2}'),
        (
            "/v1/chat/completions",
            rb'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "tools": [{"type": "function",'
            rb' "function": {"name": "f", "description": "\ud800\ud800\udc00"}}]}',
        ),
    ],
)
def test_every_text_field_is_checked_at_the_door(engine, path, body):
    rt, url = engine
    reply = post(url, path, body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["code"] == "invalid_text" and "surrogate" in reply.json()["error"]["message"]
    assert rt.active_requests == 0


def test_text_that_is_unicode_passes_the_door(engine):
    _, url = engine
    # a pair of escapes is one character; an escaped backslash before "ud800" is text
    body = rb'{"prompt": "Hi \ud83d\ude00 \\ud800", "max_tokens": 2, "temperature": 0}'
    reply = post(url, "/v1/completions", body)
    assert reply.status_code == 200, reply.text


# ------------------------------------------------------------------ item 6: a tiny temperature


def test_a_tiny_temperature_is_greedy(engine):
    rt, url = engine
    prompt = "The capital of France is"
    want = rt.generate(prompt, settings=greedy(6)).token_ids
    for t in (1e-40, 1e-300, 1e-6):
        got = rt.generate(prompt, settings=GenerationSettings(max_new_tokens=6, temperature=t, seed=1))
        assert got.token_ids == want, t
    reply = httpx.post(
        url + "/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 1e-300}, timeout=60
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == rt.generate(prompt, settings=greedy(6)).text


# ------------------------------------------------------------------ item 9: a cut-short end delimiter


def test_a_forced_end_delimiter_cut_by_max_tokens_stays_out_of_the_reasoning(demo_runtime):
    from exllama_integrations import Reasoning

    def ask(n: int):
        return demo_runtime.generate(
            GenerationRequest(
                prompt="Question: what is the capital of France?\n<think>\n",
                settings=greedy(n),
                reasoning=Reasoning(started=True, budget=4),
            )
        )

    thought = ask(4)  # the budget spent, nothing forced yet
    for n in (5, 6):  # "</think>" is 3 tokens here: cut after one, then after two of them
        cut = ask(n)
        assert cut.reasoning == thought.reasoning.rstrip() and cut.text == "", (n, cut.reasoning)
        assert "</" not in cut.reasoning


def test_llama_index_chat_returns_each_tokens_logprobs_once(demo_runtime):
    import asyncio

    from llama_index.core.base.llms.types import ChatMessage

    from exllama_integrations.llama_index import ExLlamaLLM

    llm = ExLlamaLLM(runtime=demo_runtime, temperature=0, max_new_tokens=5, logprobs=2)
    said = [ChatMessage(role="user", content="Hi")]
    for reply in (llm.chat(said), asyncio.run(llm.achat(said))):
        n = reply.raw["usage"]["completion_tokens"]
        assert len(reply.logprobs) == n, (len(reply.logprobs), n)
        *deltas, outcome = llm.stream_chat(said)
        streamed = [lp for r in deltas for lp in (r.logprobs or [])]
        assert [lp[0].token for lp in outcome.logprobs] == [lp[0].token for lp in streamed]  # the last has them all
        assert [lp[0].token for lp in reply.logprobs] == [lp[0].token for lp in streamed]


# ------------------------------------------------------------------ item 4: a hung engine (last: replaces it)


def _scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        s.name: s.value for f in text_string_to_metric_families(httpx.get(url + "/metrics").text) for s in f.samples
    }


def test_a_hung_engine_is_reported_its_requests_end_typed_and_it_is_replaced(engine, record_property):
    rt, url = engine
    (pid,) = rt.diagnostics()["engine_pids"]
    stream = rt.stream(GenerationRequest(prompt="Story: once upon a time", settings=greedy(4000, ignore_eos=True)))
    outcome: list[BaseException | None] = [None]
    first = threading.Event()

    def read() -> None:
        try:
            for _ in stream:
                first.set()
        except BaseException as e:  # noqa: BLE001 - what the reader sees is the point
            outcome[0] = e

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert first.wait(30)
    stopped = time.perf_counter()
    os.kill(pid, signal.SIGSTOP)
    try:
        reasons, unhealthy, serving = [], None, None
        while time.perf_counter() - stopped < 60:
            health = httpx.get(url + "/health", timeout=5)
            if health.status_code == 503:
                reasons.append(health.json()["reason"])
                unhealthy = unhealthy or time.perf_counter()
                if len(reasons) == 1:
                    assert _scrape(url)["exllama:healthy"] == 0.0
            elif unhealthy is not None:
                serving = time.perf_counter()
                break
            time.sleep(0.1)
        assert unhealthy is not None, "a stopped engine was never reported"
        assert unhealthy - stopped < 4.0 + 0.2 + 2.0  # HUNG_AFTER + PING_EVERY + a loaded machine's slack
        reader.join(5)
        assert isinstance(outcome[0], EngineUnavailableError) and "stopped answering" in str(outcome[0])
        assert "stopped answering" in reasons[0]
        assert any("back-off" in r for r in reasons), reasons  # said while the next start waits
        assert serving is not None, reasons[-1]
        reply = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert reply.status_code == 200, reply.text
        assert rt.diagnostics()["engine_pids"] != [pid] and rt.active_requests == 0
        assert _scrape(url)["exllama:engine_restarts"] == 1.0
        record_property("sigstop_to_unhealthy_s", round(unhealthy - stopped, 2))
        record_property("sigstop_to_serving_s", round(serving - stopped, 2))
        print(f"SIGSTOP -> unhealthy {unhealthy - stopped:.2f} s, -> a new engine serving {serving - stopped:.2f} s")
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
