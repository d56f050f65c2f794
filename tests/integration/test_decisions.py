"""Decision questions on the real demo model (CPU): exact, batch-invariant, the same at every door.

A question's probabilities are read from one prefill's logits: they sum to 1 and equal what transformers' own
forward of the prompt and each label gives (tokenized by transformers' tokenizer, not ours); the same request twice
is bitwise equal, and equal within 1e-6 inside a burst of other requests. LangChain's ``OpenAIDecisions`` and
``OpenAIClassifier`` (langchain-openai 1.8.1) answer through the server's ``/v1/decisions`` unchanged (single,
several per request, batched, async), within 1e-5 of ``ExLlamaDecisions`` in process; bad input is a typed 400 in
OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import math
import threading
import warnings

import httpx
import pytest
from servers import ThreadServer, demo_server

from exllama_integrations.contract.decisions import Choice, DecisionRequest, labels
from exllama_integrations.runtime.decisions import decider

from helpers import decision_questions

warnings.filterwarnings("ignore", message=".*is in beta.*")
MODEL = "SmolLM2-135M-Instruct"
STATE, QUESTIONS = decision_questions()


def probs(answer):
    """The distribution an answer carries, as a list."""
    if hasattr(answer, "probability"):
        return [answer.probability, 1 - answer.probability]
    return (
        [p for _, p in answer.probabilities]
        if isinstance(answer.probabilities[0], tuple)
        else list(answer.probabilities)
    )


@pytest.fixture(scope="module")
def decide(demo_runtime):
    return decider(demo_runtime)


LONG_STATE = " ".join(f"Line {i}: invoice batch {i} failed, the dashboard shows error {i * 7}." for i in range(40))
"""Over ``PREFILL_CHUNK`` tokens: the prefix is read into a cache first, then the questions after it."""


@pytest.fixture(scope="module")
def tiny_decide(tiny_runtime):
    return decider(tiny_runtime)


@pytest.mark.parametrize(("state", "on"), [(STATE, "demo"), (LONG_STATE, "tiny")], ids=["short", "long"])
def test_probabilities_sum_to_one_and_equal_the_models_own_logprobs(request, state, on):
    """The short state on the demo model; the long one (its prefix read into a cache first) on the tiny random model:
    equal to an independent forward of the same weights holds for any weights, at ~1/20 of the time."""
    import torch
    from transformers import AutoTokenizer

    decide = request.getfixturevalue("decide" if on == "demo" else "tiny_decide")
    runtime = request.getfixturevalue(f"{on}_runtime")
    result = decide.decide(DecisionRequest(state, QUESTIONS))
    assert (result.prefix_tokens > 512) == (state is LONG_STATE)
    tok = AutoTokenizer.from_pretrained(str(request.getfixturevalue(f"{on}_dir")))
    model = runtime.diagnostics()["model"]
    for q, answer, prompt in zip(QUESTIONS, result.answers, result.prompts):
        ids = tok(prompt, add_special_tokens=False).input_ids
        scores = []
        for label in q.labels:
            full = tok(prompt + label.text, add_special_tokens=False).input_ids
            assert full[: len(ids)] == ids
            with torch.inference_mode():
                logits = model(input_ids=torch.tensor([full])).logits[0].double()
            lp = torch.log_softmax(logits, dim=-1)
            scores.append(sum(float(lp[i - 1, full[i]]) for i in range(len(ids), len(full))))
        top = max(scores)
        oracle = [math.exp(s - top) / sum(math.exp(t - top) for t in scores) for s in scores]
        got = probs(answer)
        assert abs(math.fsum(got) - 1) < 1e-6
        assert max(abs(a - b) for a, b in zip(got, oracle)) < 1e-5, (q.name, got, oracle)
    team = result.answers[1]
    assert team.choice == max(team.probabilities, key=lambda vp: vp[1])[0]
    anger = result.answers[2]
    assert abs(anger.score - sum(i * p for i, p in enumerate(anger.probabilities))) < 1e-12


def test_the_prompt_follows_the_chat_template_and_is_reported(decide, demo_runtime):
    result = decide.decide(DecisionRequest(STATE, QUESTIONS[:1]))
    prompt = result.prompts[0]
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    assert f"Input:\n{STATE}\n\nQuestion: Is this request urgent?\nAnswer with exactly one of: yes, no." in prompt
    assert result.prompt_tokens == len(demo_runtime.encode(prompt))  # yes and no are one token each: read once


def test_a_question_is_bitwise_the_same_twice_beside_others_and_in_a_burst(decide, demo_runtime):
    alone = decide.decide(DecisionRequest(STATE, QUESTIONS[1:2])).answers[0]
    assert decide.decide(DecisionRequest(STATE, QUESTIONS[1:2])).answers[0] == alone
    beside = decide.decide(DecisionRequest(STATE, QUESTIONS)).answers[1]  # one forward with the others: to rounding
    assert max(abs(a - b) for a, b in zip(probs(beside), probs(alone))) < 1e-6
    burst: list = []

    def other(i: int) -> None:
        if i % 2:
            demo_runtime.generate(f"Write about {i} cats.", max_new_tokens=8, temperature=0)
        else:
            decide.decide(DecisionRequest(f"Customer {i} asks about pricing.", QUESTIONS))

    def target() -> None:
        burst.append(decide.decide(DecisionRequest(STATE, QUESTIONS[1:2])).answers[0])

    threads = [threading.Thread(target=other, args=(i,)) for i in range(4)] + [threading.Thread(target=target)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert burst and max(abs(a - b) for a, b in zip(probs(burst[0]), probs(alone))) < 1e-6


async def test_async_answers_equal_sync_and_a_gather_is_invariant(decide):
    sync = decide.decide(DecisionRequest(STATE, QUESTIONS))
    many = await asyncio.gather(*(decide.adecide(DecisionRequest(STATE, QUESTIONS)) for _ in range(3)))
    assert all(r.answers == sync.answers for r in many)


@pytest.fixture(scope="module")
def server():
    return demo_server()


@pytest.fixture(scope="module")
def lc_local(demo_dir):
    from exllama_integrations.langchain import ExLlamaDecisions

    return ExLlamaDecisions(model_dir=str(demo_dir), backend="transformers")


def lc_questions():
    from langchain_core.decisions import Choice as LcChoice
    from langchain_core.decisions import Noul as LcNoul
    from langchain_core.decisions import Score as LcScore

    return {
        "urgent": LcNoul(instructions="Is this request urgent?"),
        "team": LcChoice(
            instructions="Which team should handle this request?",
            criteria={"billing": "Payments and invoices.", "technical": "Bugs and outages.", "sales": None},
        ),
        "anger": LcScore(instructions="How frustrated is the customer?", criteria=["calm", "concerned", "angry"]),
    }


def openai_questions():
    from langchain_openai.decisions import Choice as OaChoice
    from langchain_openai.decisions import Predicate, Score

    return {
        "urgent": Predicate(instructions="Is this request urgent?"),
        "team": OaChoice(
            instructions="Which team should handle this request?",
            choices={"billing": "Payments and invoices.", "technical": "Bugs and outages.", "sales": None},
        ),
        "anger": Score(instructions="How frustrated is the customer?", levels=["calm", "concerned", "angry"]),
    }


def flat(answers: dict) -> list[float]:
    """Every probability of a response's answers (OpenAI's or LangChain's types), in a fixed order."""
    out = []
    for name in ("urgent", "team", "anger"):
        if name not in answers:
            continue
        a = answers[name]
        p = getattr(a, "probability", None)
        p = getattr(a, "noul", p)
        out.extend([p] if p is not None else list(a.probabilities.values()))
    return out


def test_openai_decisions_answers_through_the_server(server, lc_local):
    from langchain_openai.decisions import OpenAIDecisions

    client = OpenAIDecisions(base_url=server + "/v1", model=MODEL, api_key="unused")
    local = lc_local.invoke({"state": STATE, "questions": lc_questions()})
    several = client.invoke({"input": STATE, "questions": openai_questions()})
    assert several.model == MODEL and several.usage.input_tokens == local.usage["input_tokens"]
    assert max(abs(a - b) for a, b in zip(flat(several.answers), flat(local.answers))) < 1e-5
    assert several.choices["team"].choice == local.choices["team"].choice
    single = client.invoke({"input": STATE, "questions": {"urgent": openai_questions()["urgent"]}})
    assert abs(single.predicates["urgent"].probability - local.nouls["urgent"].noul) < 1e-5
    batch = client.batch([{"input": STATE, "questions": openai_questions()}] * 3)
    assert all(flat(b.answers) == flat(several.answers) for b in batch)
    again = asyncio.run(client.ainvoke({"input": STATE, "questions": openai_questions()}))
    assert flat(again.answers) == flat(several.answers)  # bitwise, through HTTP and JSON


def test_openai_classifier_and_exllama_decisions_over_base_url_agree_with_in_process(server, lc_local):
    from langchain_openai.decisions import OpenAIClassifier

    from exllama_integrations.langchain import ExLlamaDecisions

    state = {"messages": ["delete my files"], "tool_call": {"name": "rm", "args": {"path": "/"}}}
    request = {"state": state, "questions": lc_questions()}
    local = lc_local.invoke(request)
    over_http = ExLlamaDecisions(base_url=server, model=MODEL)
    remote = over_http.invoke(request)
    assert flat(asyncio.run(over_http.ainvoke(request)).answers) == flat(remote.answers)
    classifier = OpenAIClassifier(base_url=server + "/v1", model=MODEL, api_key="unused").invoke(request)
    for other in (remote, classifier):
        assert max(abs(a - b) for a, b in zip(flat(other.answers), flat(local.answers))) < 1e-5
    assert remote.metadata["prompts"] == local.metadata["prompts"]


def test_exllama_decisions_reports_usage_batches_and_awaits(lc_local):
    request = {"state": STATE, "questions": lc_questions()}
    one = lc_local.invoke(request)
    assert one.usage["input_tokens"] > 0 and one.usage["output_tokens"] == 0
    assert one.usage["total_tokens"] == one.usage["input_tokens"]
    assert set(one.metadata["prompts"]) == {"urgent", "team", "anger"} and one.metadata["backend"] == "transformers"
    assert abs(sum(one.choices["team"].probabilities.values()) - 1) < 1e-6
    assert [flat(r.answers) for r in lc_local.batch([request] * 3)] == [flat(one.answers)] * 3
    assert [flat(r.answers) for r in asyncio.run(lc_local.abatch([request] * 2))] == [flat(one.answers)] * 2


def test_box_is_refused_typed_on_a_model_without_images(lc_local):
    from langchain_core.decisions import Box

    from exllama_integrations.errors import InvalidSettingsError

    with pytest.raises(InvalidSettingsError, match="takes no images"):
        lc_local.invoke({"state": STATE, "questions": {"where": Box(instructions="Where is the cat?")}})


def test_the_router_middleware_routes_with_a_local_decision(demo_dir, lc_local):
    from langchain.agents.middleware import ModelChoice, ModelRouterMiddleware
    from langchain_core.messages import HumanMessage

    from exllama_integrations.langchain import ChatExLlama

    chat = ChatExLlama(model_dir=str(demo_dir), backend="transformers")
    router = ModelRouterMiddleware(
        choices={
            "fast": ModelChoice(model=chat, criteria="Small talk."),
            "careful": ModelChoice(model=chat, criteria="Code."),
        },
        instructions="Which model should answer?",
        classifier=lc_local,
    )
    out = router.before_agent({"messages": [HumanMessage("Write a Python parser for TOML.")]}, None)
    route = out["model_route"]
    assert route.choice in ("fast", "careful") and abs(sum(route.probabilities.values()) - 1) < 1e-6


BAD = [
    ("no labels", {"input": "hi", "questions": [{"type": "choice", "name": "a", "instructions": "b", "choices": []}]}),
    (
        "duplicate labels",
        {
            "input": "hi",
            "questions": [
                {"type": "choice", "name": "a", "instructions": "b", "choices": [{"value": "x"}, {"value": "X"}]}
            ],
        },
    ),
    ("unknown question type", {"input": "hi", "questions": [{"type": "rank", "name": "a", "instructions": "b"}]}),
    ("empty state", {"input": "   ", "questions": [{"type": "predicate", "name": "a", "instructions": "b"}]}),
    ("no questions", {"input": "hi", "questions": []}),
    (
        "a label the start of another",
        {
            "input": "hi",
            "questions": [
                {
                    "type": "choice",
                    "name": "a",
                    "instructions": "b",
                    "choices": [{"value": "bug"}, {"value": "bug report"}],
                }
            ],
        },
    ),
    ("a box", {"input": "hi", "questions": [{"type": "box", "name": "a", "instructions": "Where?"}]}),
    (
        "two questions of one name",
        {"input": "hi", "questions": [{"type": "predicate", "name": "a", "instructions": "b"}] * 2},
    ),
]


@pytest.mark.parametrize(("why", "body"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_typed_400_in_openais_shape(server, why, body):
    r = httpx.post(server + "/v1/decisions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"] and error["code"]


def test_openai_decisions_sees_a_bad_request_as_openais_error(server):
    import openai
    from langchain_openai.decisions import Choice as OaChoice
    from langchain_openai.decisions import OpenAIDecisions

    client = OpenAIDecisions(base_url=server + "/v1", model=MODEL, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="twice"):
        client.invoke({"input": "hi", "questions": {"a": OaChoice(instructions="b", choices={"x": None, "X": None})}})


def test_the_route_needs_the_key_and_is_admitted(demo_runtime):
    from exllama_integrations.serve.state import ServeLimits

    body = {"input": STATE, "questions": [{"type": "predicate", "name": "q", "instructions": "Urgent?"}]}
    auth = {"Authorization": "Bearer secret"}
    s = ThreadServer(demo_runtime, api_key="secret")
    try:
        assert httpx.post(s.url + "/v1/decisions", json=body, timeout=60).status_code == 401
        r = httpx.post(s.url + "/v1/decisions", json=body, headers=auth, timeout=120)
        assert r.status_code == 200 and r.json()["answers"][0]["name"] == "q"
    finally:
        s.stop()
    full = ThreadServer(demo_runtime, limits=ServeLimits(max_pending=0))  # admission refuses every unit of work
    try:
        r = httpx.post(full.url + "/v1/decisions", json=body, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_overloaded"
    finally:
        full.stop()


def test_auto_mode_middleware_blocks_or_runs_by_the_local_probability(lc_local):
    from langchain.agents.middleware import AutoModeMiddleware
    from langchain_core.messages import HumanMessage, ToolMessage
    from langgraph.prebuilt.tool_node import ToolCallRequest

    auto = AutoModeMiddleware(tools=["delete_everything"], classifier=lc_local)
    call = {"name": "delete_everything", "args": {"path": "/"}, "id": "call-1", "type": "tool_call"}
    request = ToolCallRequest(tool_call=call, tool=None, state={"messages": [HumanMessage("hi")]}, runtime=None)
    ran: list = []

    def handler(r):
        ran.append(r)
        return ToolMessage("done", tool_call_id="call-1")

    out = auto.wrap_tool_call(request, handler)
    state = auto._classification_state(request)
    risk = lc_local.invoke({"state": state, "questions": {"is_risky": _auto_question(auto)}}).nouls["is_risky"].noul
    assert (out.status == "error") == (risk >= 0.5) and bool(ran) == (risk < 0.5)


def _auto_question(auto):
    from langchain_core.decisions import Noul

    return Noul(instructions=auto.config.instructions, criteria=auto.config.criteria)


def test_the_llama_index_selector_picks_by_the_same_scores(demo_runtime, decide):
    from llama_index.core.tools.types import ToolMetadata

    from exllama_integrations.llama_index import ExLlamaSelector
    from exllama_integrations.llama_index.selectors import INSTRUCTIONS, option_labels

    choices = [
        ToolMetadata(name="billing", description="Payments and invoices."),
        ToolMetadata(name="technical", description="Bugs and outages."),
        ToolMetadata(name="sales", description="Pricing questions."),
    ]
    selector = ExLlamaSelector(runtime=demo_runtime, max_outputs=2)
    out = selector.select(choices, STATE)
    want = decide.decide(DecisionRequest(STATE, (Choice("selection", INSTRUCTIONS, option_labels(choices)),)))
    ranked = sorted(range(3), key=lambda i: -want.answers[0].probabilities[i][1])
    assert out.inds == ranked[:2] and f"{want.answers[0].probabilities[ranked[0]][1]:.4f}" in out.reasons[0]
    assert asyncio.run(selector.aselect(choices, STATE)).inds == out.inds


def test_a_request_is_one_forward_the_prefix_read_once(decide, demo_runtime):
    """The shared prefix, every question and every label token are one forward (packed as a tree), however many
    questions and labels of several tokens the request has; every position is computed once."""
    model = demo_runtime.diagnostics()["model"]
    plan = decide.plan(DecisionRequest(STATE, QUESTIONS))
    assert len(plan.jobs) == 1 and any(len(lab) > 1 for b in plan.jobs[0].branches for lab in b.labels)
    calls: list[int] = []
    forward = model.forward

    def counted(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape[1])
        return forward(*args, **kwargs)

    model.forward = counted
    try:
        result = decide.decide(DecisionRequest(STATE, QUESTIONS))
    finally:
        del model.forward
    assert len(calls) == 1
    assert sum(calls) == result.prompt_tokens  # every position computed once


def test_a_question_over_a_forwards_size_is_scored_label_by_label_alike(tiny_decide, tiny_runtime):
    """A question whose labels alone are over 512 tokens is read label by label (a packed mask would grow as the
    square of its tokens): its scores agree with the packed tree's, two independent paths, to rounding (on the tiny
    random model: two paths over the same weights agree for any weights)."""
    from exllama_integrations.backends.transformers import _Session
    from exllama_integrations.backends.transformers_decisions import score_labels

    many = Choice(
        "topic",
        "Which topic is it?",
        labels(*(f"topic number {i} about invoices, refunds and outages" for i in range(60))),
    )
    (job,) = tiny_decide.plan(DecisionRequest(STATE, (many,))).jobs
    assert sum(len(lab) - 1 for lab in job.branches[0].labels) > 512
    backend = tiny_runtime._require_backend()
    import torch

    with torch.inference_mode():
        by_label = score_labels(_Session(backend), job, 512)
        packed = score_labels(_Session(backend), job, 1 << 20)
    assert max(abs(a - b) for a, b in zip(by_label[0], packed[0])) < 1e-4
    result = tiny_decide.decide(DecisionRequest(STATE, (many,)))  # through the runtime: the label-by-label path
    assert abs(math.fsum(p for _, p in result.answers[0].probabilities) - 1) < 1e-6


def test_on_exllamav3_the_benchmarks_requests_are_one_forward_a_question(tiny_decide):
    """exllamav3's plan (``backends/exllamav3/decision_plan.py``) of benchmarks/gpu_decisions.py's requests on
    SmolLM2's tokenizer (the benchmark's): a question under a page is one forward, its labels of two tokens fused
    into it, so one Choice is one forward and three questions are three (docs/decisions.md)."""
    from exllama_integrations.backends.exllamav3.decision_plan import plan
    from exllama_integrations.contract.decisions import Label, Noul, Score

    team = Choice(
        "team", "Which team should handle this request?", tuple(Label(t) for t in ("billing", "technical", "sales"))
    )
    three = (
        Noul("urgent", "Is this request urgent?"),
        team,
        Score("anger", "How frustrated is the customer?", labels("calm", "concerned", "angry")),
    )
    state = "Ticket 3: the app crashes on login (customer #1003). Please help."
    for questions, forwards in (((team,), 1), (three, 3)):
        (job,) = tiny_decide.plan(DecisionRequest(state, questions)).jobs
        assert any(len(lab) > 1 for b in job.branches for lab in b.labels)  # labels of several tokens, no forward more
        assert len(plan(job).steps) == forwards
