"""Decision questions as values: the checks every door relies on, the arithmetic, the wire shape, the state's text.

No model here (tests/integration/test_decisions.py runs the real one): what a request refuses (typed, 400, the
field named), how label log-probabilities become answers, that OpenAI's Decisions shape goes both ways unchanged,
and that a LangChain state reads the same in process as OpenAI's client sends it to the server.
"""

from __future__ import annotations

import math

import pytest

from exllama_integrations.backends.inbox import WorkerTask
from exllama_integrations.contract.decision_wire import answer_to_wire, question_of, question_to_wire, result_of_wire
from exllama_integrations.contract.decisions import (
    Box,
    Choice,
    DecisionRequest,
    DecisionResult,
    Label,
    Noul,
    Score,
    answer_of,
    confidence,
    distribution,
    labels,
)
from exllama_integrations.errors import InvalidSettingsError, MediaError, RuntimeClosedError

TEAM = Choice("team", "Which team?", (Label("billing", "Payments."), Label("tech"), Label(True)))


def test_distribution_is_the_softmax_and_sums_to_one():
    lps = [-0.3, -2.0, -7.5, -0.31]
    p = distribution(lps)
    assert abs(math.fsum(p) - 1) < 1e-15
    z = sum(math.exp(x) for x in lps)
    assert all(abs(a - math.exp(x) / z) < 1e-15 for a, x in zip(p, lps))
    assert distribution([-1000.0, -1001.0])[0] == pytest.approx(1 / (1 + math.exp(-1)))  # no underflow


def test_confidence_is_one_when_certain_and_zero_when_uniform():
    assert confidence([1.0, 0.0, 0.0]) == 1.0
    assert confidence([0.25] * 4) == pytest.approx(0.0, abs=1e-12)
    assert 0 < confidence([0.7, 0.2, 0.1]) < 1


def test_answers_from_label_logprobs():
    noul = answer_of(Noul("u", "Urgent?"), [math.log(0.3), math.log(0.1)])
    assert noul.probability == pytest.approx(0.75)
    choice = answer_of(TEAM, [-1.0, -1.0, -3.0])
    assert choice.choice == "billing" and [v for v, _ in choice.probabilities] == ["billing", "tech", True]
    score = answer_of(Score("s", "How?", labels("a", "b", "c")), [math.log(0.2), math.log(0.3), math.log(0.5)])
    assert score.score == pytest.approx(1.3) and score.legend == ("a", "b", "c")


@pytest.mark.parametrize(
    ("state", "questions", "param"),
    [
        ("   ", (Noul("a", "b"),), "input"),
        ("hi", (), "questions"),
        ("hi", (Noul("a", "b"), Noul("a", "c")), "questions[1]"),
        ("hi", (Noul("a", " "),), "questions[0].instructions"),
        ("hi", (Choice("a", "b", ()),), "questions[0].labels"),
        ("hi", (Choice("a", "b", labels("Yes", "yes")),), "questions[0].labels"),
        ("hi", (Choice("a", "b", labels("", "x")),), "questions[0].labels"),
        ("hi", (Score("a", "b", labels("only")),), "questions[0].levels"),
        ("hi", (Score("a", "b", labels(*"abcdefghijk")),), "questions[0].levels"),
        ("hi", ("not a question",), "questions[0].type"),
        ("hi", tuple(Noul(f"q{i}", "b") for i in range(65)), "questions"),
    ],
)
def test_a_bad_request_is_refused_typed_naming_the_field(state, questions, param):
    with pytest.raises(InvalidSettingsError) as e:
        DecisionRequest(state, questions)
    assert e.value.param == param and type(e.value).status == 400


def test_the_wire_shape_goes_both_ways():
    qs = (Noul("u", "Urgent?", yes="Down", no=None), TEAM, Score("s", "How?", labels("x", "y")), Box("b", "Where?"))
    assert tuple(question_of(question_to_wire(q)) for q in qs) == qs
    assert question_to_wire(qs[0])["type"] == "predicate" and question_to_wire(TEAM)["choices"][2] == {"value": True}
    request = DecisionRequest("hi", qs[:3])
    answers = tuple(answer_of(q, [-0.5, -1.5, -2.0][: len(q.labels)]) for q in qs[:3])
    body = {"model": "m", "answers": [answer_to_wire(a) for a in answers], "usage": {"input_tokens": 9}}
    back = result_of_wire(body, request)
    assert back.answers == answers and back.prompt_tokens == 9 and back.model == "m"
    assert isinstance(back, DecisionResult)


def test_a_langchain_state_reads_the_same_in_process_as_openais_client_sends_it():
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_openai.decisions._classifier_input import _to_classifier_input

    from exllama_integrations.langchain.decisions import state_text
    from exllama_integrations.serve.decisions.convert import input_text

    states = [
        "Production is down.",
        HumanMessage("I was charged twice."),
        [HumanMessage("first"), HumanMessage("second")],
        {"messages": [HumanMessage("delete it"), AIMessage("ok")], "tool_call": {"name": "rm", "args": {"p": "/"}}},
        [{"a": 1}, {"b": [1, 2]}],
    ]
    for state in states:
        assert input_text(_to_classifier_input(state)) == state_text(state), state


def test_images_are_refused_typed_at_both_doors():
    from langchain_core.messages import HumanMessage

    from exllama_integrations.langchain.decisions import state_text
    from exllama_integrations.serve.decisions.convert import input_text

    image = {"type": "image", "base64": "AAAA", "mime_type": "image/png"}
    with pytest.raises(MediaError):
        state_text(HumanMessage(content=[{"type": "text", "text": "look"}, image]))
    with pytest.raises(MediaError):
        input_text([{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]}])


def test_worker_task_hands_back_result_error_or_closed():
    ok, bad, late = WorkerTask(lambda: 7), WorkerTask(lambda: 1 / 0), WorkerTask(lambda: 1)
    ok.run()
    bad.run()
    late.emit(None)  # the backend closed before it ran
    assert ok.future.result() == 7
    with pytest.raises(ZeroDivisionError):
        bad.future.result()
    with pytest.raises(RuntimeClosedError):
        late.future.result()


def test_a_runtime_whose_backend_cannot_score_labels_is_refused_typed():
    from types import SimpleNamespace

    from exllama_integrations.errors import UnsupportedTaskError
    from exllama_integrations.runtime.local.decisions import LocalDecider

    exllamav2 = SimpleNamespace(name="exllamav2", generate=None)  # a backend without score_labels
    runtime = SimpleNamespace(engine="thread", _require_backend=lambda: exllamav2)
    with pytest.raises(UnsupportedTaskError, match="backend 'exllamav2'.*'transformers' or 'exllamav3'"):
        LocalDecider(runtime)._scorer()  # type: ignore[arg-type]


def test_exllama_decisions_refuses_an_unknown_argument_before_loading():
    from exllama_integrations.langchain import ExLlamaDecisions

    with pytest.raises(InvalidSettingsError, match="did you mean 'model_dir'"):
        ExLlamaDecisions(model_dri="somewhere")


def test_the_exllamav3_driver_runs_work_on_its_own_thread_between_steps():
    import threading

    from exllama_integrations.backends.exllamav3.driver import Driver
    from exllama_integrations.backends.inbox import Inbox

    box = Inbox(0.0)
    driver = Driver(object(), box, lambda r: (None, False), lambda r: None)  # no jobs: the generator is never asked
    driver.start()
    try:
        task = WorkerTask(lambda: threading.current_thread().name)
        box.put([task])
        assert task.future.result(10) == "exllama-exllamav3-driver"
    finally:
        driver.stop()
