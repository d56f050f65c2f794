"""Decision questions and answers in the shape of OpenAI's Decisions API (``POST /v1/decisions``), both ways.

The shape is the one langchain-openai 1.8.1's ``OpenAIDecisions`` and ``OpenAIClassifier`` send and read
(``langchain_openai/decisions/types.py``, ``base.py``, ``classifier.py``): questions are a list of
``{"type": "predicate" | "choice" | "score", "name", "instructions", ...}`` (a choice's ``choices`` of
``{"value", "description"?}``, a score's ``levels`` of ``{"label", "description"?}``); answers a list of
``{"name", "type", ...}`` (a predicate's ``probability``; a choice's ``choice``, ``probabilities`` of ``{"value",
"probability"}`` and ``confidence``; a score's ``score``, ``probabilities`` of ``{"value", "label", "probability"}``
and ``confidence``), with ``usage`` of ``input_tokens`` / ``output_tokens`` / ``total_tokens``.

Two extensions, which OpenAI's clients leave alone: a predicate's ``criteria`` (``{"true", "false"}``, LangChain's
``NoulCriteria``, shown to the model as "Answer yes if: ...") and a ``box`` question (refused, typed); the answer's
``metadata`` holds the prompt each question became and the tokens read once for all (``prefix_tokens``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .decisions import (
    Box,
    Choice,
    ChoiceAnswer,
    DecisionRequest,
    DecisionResult,
    Label,
    Noul,
    NoulAnswer,
    Question,
    Score,
    ScoreAnswer,
)

WIRE_KINDS = {"noul": "predicate", "choice": "choice", "score": "score", "box": "box"}
"""The contract's question kinds by their name on the wire."""


def question_to_wire(q: Question) -> dict[str, Any]:
    """One question as the API takes it."""
    out: dict[str, Any] = {"type": WIRE_KINDS[q.kind], "name": q.name, "instructions": q.instructions}
    if isinstance(q, Noul) and (q.yes or q.no):
        out["criteria"] = {"true": q.yes, "false": q.no}
    elif isinstance(q, Choice):
        out["choices"] = [_option(label, "value") for label in q.labels]
    elif isinstance(q, Score):
        out["levels"] = [_option(label, "label") for label in q.levels]
    return out


def _option(label: Label, key: str) -> dict[str, Any]:
    return {key: label.value, **({"description": label.description} if label.description is not None else {})}


def request_to_wire(request: DecisionRequest, model: str) -> dict[str, Any]:
    """A request body for ``POST /v1/decisions``."""
    return {"model": model, "input": request.state, "questions": [question_to_wire(q) for q in request.questions]}


def question_of(item: Mapping[str, Any]) -> Question:
    """A question from its wire form (already checked for shape by the server's models, or made by our client)."""
    kind, name, text = item["type"], item["name"], item["instructions"]
    if kind == "predicate":
        criteria = item.get("criteria") or {}
        return Noul(name, text, criteria.get("true"), criteria.get("false"))
    if kind == "choice":
        return Choice(name, text, tuple(Label(c["value"], c.get("description")) for c in item["choices"]))
    if kind == "score":
        return Score(name, text, tuple(Label(lv["label"], lv.get("description")) for lv in item["levels"]))
    return Box(name, text)


def answer_to_wire(answer: Any) -> dict[str, Any]:
    """One answer as the API gives it."""
    if isinstance(answer, NoulAnswer):
        return {"name": answer.name, "type": "predicate", "probability": answer.probability}
    if isinstance(answer, ChoiceAnswer):
        return {
            "name": answer.name,
            "type": "choice",
            "choice": answer.choice,
            "probabilities": [{"value": v, "probability": p} for v, p in answer.probabilities],
            "confidence": answer.confidence,
        }
    assert isinstance(answer, ScoreAnswer)
    levels = zip(answer.legend, answer.probabilities)
    return {
        "name": answer.name,
        "type": "score",
        "score": answer.score,
        "probabilities": [{"value": i, "label": lab, "probability": p} for i, (lab, p) in enumerate(levels)],
        "confidence": answer.confidence,
    }


def usage_to_wire(result: DecisionResult) -> dict[str, Any]:
    """The usage object: the tokens read are input; nothing is output."""
    return {
        "input_tokens": result.prompt_tokens,
        "output_tokens": 0,
        "total_tokens": result.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens_details": {"reasoning_tokens": 0},
    }


def metadata_to_wire(request: DecisionRequest, result: DecisionResult) -> dict[str, Any]:
    """The extension: each question's prompt, by name, and the tokens read once for every question."""
    prompts = {q.name: p for q, p in zip(request.questions, result.prompts)}
    return {"prompts": prompts, "prefix_tokens": result.prefix_tokens}


def result_of_wire(body: Mapping[str, Any], request: DecisionRequest) -> DecisionResult:
    """A result from the API's answer to ``request`` (KeyError/TypeError/ValueError when it is not that shape)."""
    by_name = {a["name"]: a for a in body["answers"]}
    answers: list[Any] = []
    for q in request.questions:
        a = by_name[q.name]
        if a["type"] == "predicate":
            answers.append(NoulAnswer(q.name, float(a["probability"])))
        elif a["type"] == "choice":
            pairs = tuple((item["value"], float(item["probability"])) for item in a["probabilities"])
            answers.append(ChoiceAnswer(q.name, a["choice"], pairs, float(a["confidence"])))
        elif a["type"] == "score":
            items: Sequence[Mapping[str, Any]] = a["probabilities"]
            probs = tuple(float(item["probability"]) for item in items)
            legend = tuple(str(item.get("label", "")) for item in items)
            answers.append(ScoreAnswer(q.name, float(a["score"]), probs, legend, float(a["confidence"])))
        else:
            raise ValueError(f"answer type {a['type']!r}")
    usage = body.get("usage") or {}
    meta = body.get("metadata") or {}
    prompts = meta.get("prompts") or {}
    return DecisionResult(
        answers=tuple(answers),
        prompt_tokens=int(usage.get("input_tokens") or 0),
        model=str(body.get("model") or ""),
        prompts=tuple(str(prompts.get(q.name, "")) for q in request.questions),
        prefix_tokens=int(meta.get("prefix_tokens") or 0),
    )


__all__ = [
    "WIRE_KINDS",
    "answer_to_wire",
    "metadata_to_wire",
    "question_of",
    "question_to_wire",
    "request_to_wire",
    "result_of_wire",
    "usage_to_wire",
]
