"""``/v1/decisions`` under ``serve``'s default mode: the model in an engine process, the scoring over its wire.

``exllama-integrations serve DEMO`` (no ``--engine``: an engine process) answers LangChain's ``OpenAIDecisions``
(Noul, Choice and Score; singly, several per request, batched, async) bitwise as ``engine="thread"`` does in process
on the same backend; twice the same; alone and inside a concurrent burst of generations and other decisions within
1e-6; behind its key; typed 400s in OpenAI's shape. Beside it, a runtime with ``engine="process"`` (what ``serve``
builds) on test-time watchdog settings: a client that goes away drops its scoring, a hung engine and a killed one
end a decision with a typed 503 like the other routes, and admission counts a decision's questions.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from servers import ThreadServer, wait_until_up

from exllama_integrations import EngineUnavailableError, ExLlamaRuntime
from exllama_integrations.contract.decisions import DecisionRequest
from exllama_integrations.runtime.decisions import decider

from helpers import decision_questions

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:.*is in beta")]
MODEL = "SmolLM2-135M-Instruct"
STATE, QUESTIONS = decision_questions()
KEY = "decide-secret"


def oa_questions(names=("urgent", "team", "anger")) -> dict:
    from langchain_openai.decisions import Choice as OaChoice
    from langchain_openai.decisions import Predicate
    from langchain_openai.decisions import Score as OaScore

    every = {
        "urgent": Predicate(instructions="Is this request urgent?"),
        "team": OaChoice(
            instructions="Which team should handle this request?",
            choices={"billing": "Payments and invoices.", "technical": "Bugs and outages.", "sales": None},
        ),
        "anger": OaScore(instructions="How frustrated is the customer?", levels=["calm", "concerned", "angry"]),
    }
    return {n: every[n] for n in names}


def flat_oa(answers: dict) -> list[float]:
    out: list[float] = []
    for name in ("urgent", "team", "anger"):
        if name in answers:
            a = answers[name]
            p = getattr(a, "probability", None)
            out.extend([p] if p is not None else list(a.probabilities.values()))
    return out


def flat_local(result) -> list[float]:
    out: list[float] = []
    for a in result.answers:
        if hasattr(a, "probability"):
            out.append(a.probability)
        elif a.kind == "choice":
            out.extend(p for _, p in a.probabilities)
        else:
            out.extend(a.probabilities)
    return out


@pytest.fixture(scope="module")
def served(demo_dir):
    """``serve DEMO`` in its default mode (an engine process), behind a key."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "exllama_integrations", "serve", str(demo_dir), "--backend", "transformers"]
    proc = subprocess.Popen(
        [*command, "--host", "127.0.0.1", "--port", str(port), "--api-key", KEY],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(url, 180, proc)
        health = httpx.get(url + "/health", timeout=10)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)
    assert health.status_code == 200


def client(url: str, **kw):
    from langchain_openai.decisions import OpenAIDecisions

    return OpenAIDecisions(base_url=url + "/v1", model=MODEL, api_key=KEY, **kw)


def test_openai_decisions_in_the_default_mode_equal_thread_mode_bitwise(served, demo_runtime):
    assert demo_runtime.engine == "thread"
    local = decider(demo_runtime)
    want_all = flat_local(local.decide(DecisionRequest(STATE, QUESTIONS)))
    want_one = flat_local(local.decide(DecisionRequest(STATE, QUESTIONS[:1])))
    c = client(served)
    several = c.invoke({"input": STATE, "questions": oa_questions()})
    assert several.model == MODEL and several.usage.input_tokens > 0
    assert flat_oa(several.answers) == want_all  # bitwise: the engine's floats cross two wires exactly
    single = c.invoke({"input": STATE, "questions": oa_questions(["urgent"])})
    assert flat_oa(single.answers) == want_one
    for name in ("team", "anger"):  # each kind alone
        i = ("urgent", "team", "anger").index(name)
        alone = flat_local(local.decide(DecisionRequest(STATE, QUESTIONS[i : i + 1])))
        assert flat_oa(c.invoke({"input": STATE, "questions": oa_questions([name])}).answers) == alone
    assert flat_oa(c.invoke({"input": STATE, "questions": oa_questions()}).answers) == want_all  # twice: the same
    batch = c.batch([{"input": STATE, "questions": oa_questions()}] * 3)
    assert [flat_oa(b.answers) for b in batch] == [want_all] * 3
    again = asyncio.run(c.ainvoke({"input": STATE, "questions": oa_questions()}))
    assert flat_oa(again.answers) == want_all


def test_alone_and_in_a_concurrent_burst_agree_within_1e_6(served):
    c = client(served)
    alone = flat_oa(c.invoke({"input": STATE, "questions": oa_questions(["team"])}).answers)
    burst: list[list[float]] = []
    auth = {"Authorization": f"Bearer {KEY}"}

    def other(i: int) -> None:
        if i % 2:
            body = {"model": MODEL, "prompt": f"Write about {i} cats.", "max_tokens": 8, "temperature": 0}
            assert httpx.post(served + "/v1/completions", json=body, headers=auth, timeout=300).status_code == 200
        else:
            c.invoke({"input": f"Customer {i} asks about pricing.", "questions": oa_questions()})

    def target() -> None:
        burst.append(flat_oa(c.invoke({"input": STATE, "questions": oa_questions(["team"])}).answers))

    threads = [threading.Thread(target=other, args=(i,)) for i in range(4)] + [threading.Thread(target=target)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert burst and max(abs(a - b) for a, b in zip(burst[0], alone)) < 1e-6


def test_the_key_and_bad_input_are_answered_typed(served):
    import openai
    from langchain_openai.decisions import Choice as OaChoice
    from langchain_openai.decisions import OpenAIDecisions

    body = {"input": STATE, "questions": [{"type": "predicate", "name": "q", "instructions": "Urgent?"}]}
    assert httpx.post(served + "/v1/decisions", json=body, timeout=60).status_code == 401
    bad = {"input": "hi", "questions": [{"type": "choice", "name": "a", "instructions": "b", "choices": []}]}
    r = httpx.post(served + "/v1/decisions", json=bad, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    wrong = OpenAIDecisions(base_url=served + "/v1", model=MODEL, api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="twice"):
        wrong.invoke({"input": "hi", "questions": {"a": OaChoice(instructions="b", choices={"x": None, "X": None})}})


@pytest.fixture(scope="module")
def engine_rt(demo_dir):
    """What ``serve`` builds, in this process so its engine can be stopped and killed: an engine-process runtime
    whose watchdog runs on test time (hung after 4 s), and a server over it."""
    from exllama_integrations.runtime.engine import client as engine_client

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_client, "PING_EVERY", 0.2)
        mp.setattr(engine_client, "HUNG_AFTER", 4.0)
        rt = ExLlamaRuntime(demo_dir, "transformers", engine="process")
        server = ThreadServer(rt)
        try:
            yield rt, server
        finally:
            server.stop()
            rt.close()


def engine_of(rt):
    return rt.diagnostics()["engines"][0]


def wait_healthy(rt, seconds: float = 120) -> None:
    t0 = time.monotonic()
    while rt.health() is not None:
        assert time.monotonic() - t0 < seconds, rt.health()
        time.sleep(0.2)


def test_a_client_that_goes_away_drops_its_scoring(engine_rt):
    rt, _ = engine_rt
    engine = engine_of(rt)
    decide = decider(rt)
    os.kill(engine.pid, signal.SIGSTOP)  # the job waits in the channel: the caller's cancel comes first
    try:

        async def gone() -> None:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(decide.adecide(DecisionRequest(STATE, QUESTIONS[:1])), 0.5)

        asyncio.run(gone())
        assert engine.load == 0  # nothing is waited for any more
    finally:
        os.kill(engine.pid, signal.SIGCONT)
    want = flat_local(decider(rt).decide(DecisionRequest(STATE, QUESTIONS[:1])))
    assert want and engine.load == 0  # the engine goes on answering


def test_admission_counts_a_decisions_questions(engine_rt):
    from exllama_integrations.serve.state import ServeLimits

    rt, _ = engine_rt
    body = {
        "input": STATE,
        "questions": [{"type": "predicate", "name": f"q{i}", "instructions": "Urgent?"} for i in range(3)],
    }
    s = ThreadServer(rt, limits=ServeLimits(max_pending=2))
    try:
        r = httpx.post(s.url + "/v1/decisions", json=body, timeout=60)
        assert r.status_code == 200  # one request larger than the limit runs alone
        state = s.app.state.serve
        state.pending = 1  # one generation in flight: three questions more are over the limit of two
        r = httpx.post(s.url + "/v1/decisions", json=body, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_overloaded"
        state.pending = 0
    finally:
        s.stop()


def test_a_hung_then_a_killed_engine_end_a_decision_typed(engine_rt):
    rt, server = engine_rt
    body = {"input": STATE, "questions": [{"type": "predicate", "name": "q", "instructions": "Urgent?"}]}
    engine = engine_of(rt)
    pid = engine.pid
    os.kill(pid, signal.SIGSTOP)  # hung: no pong for HUNG_AFTER seconds
    r = httpx.post(server.url + "/v1/decisions", json=body, timeout=120)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "engine_unavailable" and "stopped answering" in r.json()["error"]["message"]
    wait_healthy(rt)
    assert engine.pid != pid
    os.kill(engine.pid, signal.SIGKILL)
    with pytest.raises(EngineUnavailableError):
        decider(rt).decide(DecisionRequest(STATE, QUESTIONS[:1]))
    wait_healthy(rt)
    r = httpx.post(server.url + "/v1/decisions", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["answers"][0]["name"] == "q"
