"""Decision questions answered by an in-process runtime: prompts rendered and tokenized here, labels scored below.

:class:`LocalDecider` turns a :class:`~...contract.decisions.DecisionRequest` into the prompt of each question (the
layout of :mod:`...chat.decisions`, through the model's chat template), finds the part every question shares (the
system turn and the state, up to ``Question:``), tokenizes each label as it follows the prompt, and hands the
backend one :class:`~...contract.decisions.LabelScoring` per shared prefix (one, for every question about one state);
the backend's worker reads it between decoding steps. The answers come from the labels' log-probabilities
(:func:`~...contract.decisions.answer_of`). Nothing is generated and nothing is sampled.

The split into prefix and suffix depends only on the state and the question itself, never on the other questions
of the request or on what else the backend runs, and every forward is one row: a question's probabilities are
the same alone, beside other questions and inside a burst of other requests.
"""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...chat.decisions import decision_messages, plain_prompt, question_text
from ...contract.decisions import (
    Box,
    DecisionRequest,
    DecisionResult,
    LabelBranch,
    LabelLogprobs,
    LabelScoring,
    Question,
    ScoresLabels,
    answer_of,
)
from ...errors import ContextLengthError, InvalidSettingsError, UnsupportedTaskError

if TYPE_CHECKING:
    from .runtime import ExLlamaRuntime

MARKER = "\u2063exllama-decision-question\u2063"
"""Stands for the question while the shared part of the prompt is found (the text before it in the rendering)."""
LABEL_CONTEXT_CHARS = 64
"""Characters of the prompt's end a label is tokenized after (so it gets the tokens it has in the reply)."""


def refuse_box(question: Box, accepts_images: bool) -> InvalidSettingsError:
    """Why a Box question is not answered here (typed, 400)."""
    if not accepts_images:
        why = "this model takes no images, and a Box question locates something in an image"
    else:
        why = (
            "a place in an image is coordinates, not a label, and decisions here are read from label probabilities "
            "only; ask the chat model for the box instead"
        )
    return InvalidSettingsError(
        f"the Box question {question.name!r} is not answered: {why}.", param="questions", reason="unsupported_question"
    )


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True)
class DecisionPlan:
    """The jobs a request becomes, and where each question's label scores are in their answers."""

    request: DecisionRequest
    jobs: tuple[LabelScoring, ...]
    places: tuple[tuple[int, int], ...]
    """Per question: (job, branch)."""
    prompts: tuple[str, ...]
    model: str

    def result(self, scores: list[LabelLogprobs]) -> DecisionResult:
        """The answers from each job's label log-probabilities."""
        answers = tuple(
            answer_of(q, scores[job][branch]) for q, (job, branch) in zip(self.request.questions, self.places)
        )
        return DecisionResult(
            answers=answers,
            prompt_tokens=sum(j.tokens_read for j in self.jobs),
            model=self.model,
            prompts=self.prompts,
            prefix_tokens=sum(len(j.prefix) for j in self.jobs),
        )


class LocalDecider:
    """The :class:`~...contract.decisions.Decides` capability of an :class:`~.runtime.ExLlamaRuntime`."""

    def __init__(self, runtime: ExLlamaRuntime) -> None:
        self.runtime = runtime

    def _render(self, state: str, part: str) -> str:
        rt = self.runtime
        if rt.model_info().has_chat_template:
            return rt.chat_prompt(decision_messages(state, part), add_generation_prompt=True)
        return plain_prompt(state, part)

    def _label_ids(self, prompt: str, question: Question, where: str) -> tuple[tuple[int, ...], ...]:
        rt, tail = self.runtime, prompt[-LABEL_CONTEXT_CHARS:]
        before = rt.encode(tail)
        out: list[tuple[int, ...]] = []
        for label in question.labels:
            after = rt.encode(tail + label.text)
            ids = after[len(before) :] if after[: len(before)] == before else rt.encode(label.text)
            if not ids:
                raise InvalidSettingsError(f"{where}: the label {label.text!r} encodes to no tokens.", param=where)
            out.append(tuple(ids))
        for i, a in enumerate(out):
            for j, b in enumerate(out):
                if i != j and len(a) < len(b) and b[: len(a)] == a:
                    raise InvalidSettingsError(
                        f"{where} ({question.name!r}): the label {question.labels[i].text!r} is the start of the label "
                        f"{question.labels[j].text!r} (as tokens), so a reply could not tell them apart; rename one.",
                        param=where,
                        reason="invalid_question",
                    )
        return tuple(out)

    def plan(self, request: DecisionRequest) -> DecisionPlan:
        """Render and tokenize every question (typed errors here, before anything runs).

        Raises:
            InvalidSettingsError: a Box question, or labels a reply could not tell apart.
            ContextLengthError: a question's prompt and longest label exceed the context.
        """
        info = self.runtime.model_info()
        for q in request.questions:
            if isinstance(q, Box):
                raise refuse_box(q, info.accepts_images)
        rt = self.runtime
        shared = self._render(request.state, MARKER)
        cut = shared.find(MARKER)
        shared_ids = rt.encode(shared[:cut]) if cut > 0 else []
        prefixes: dict[tuple[int, ...], list[LabelBranch]] = {}
        places: list[tuple[tuple[int, ...], int]] = []
        prompts: list[str] = []
        for i, q in enumerate(request.questions):
            where = f"questions[{i}]"
            prompt = self._render(request.state, question_text(q))
            ids = rt.encode(prompt)
            label_ids = self._label_ids(prompt, q, where)
            longest = max(len(lab) for lab in label_ids)
            if len(ids) + longest > info.context_length:
                raise ContextLengthError(len(ids) + longest - 1, 1, info.context_length)
            keep = max(1, _common(shared_ids, ids))  # never empty: the backend reads a prefix first
            prefix = tuple(ids[:keep])
            branches = prefixes.setdefault(prefix, [])
            places.append((prefix, len(branches)))
            branches.append(LabelBranch(tuple(ids[keep:]), label_ids))
            prompts.append(prompt)
        order = list(prefixes)
        jobs = tuple(LabelScoring(p, tuple(prefixes[p])) for p in order)
        where_of = {p: k for k, p in enumerate(order)}
        return DecisionPlan(
            request,
            jobs,
            tuple((where_of[p], b) for p, b in places),
            tuple(prompts),
            info.name,
        )

    def _scorer(self) -> ScoresLabels:
        backend = self.runtime._require_backend()
        if not isinstance(backend, ScoresLabels):
            raise UnsupportedTaskError(
                f"decisions are read from label probabilities, which backend {backend.name!r} does not compute; load "
                "the model on backend 'transformers' or 'exllamav3'."
            )
        return backend

    def decide(self, request: DecisionRequest) -> DecisionResult:
        """Answer every question of ``request`` (see the module docstring)."""
        plan = self.plan(request)
        scorer = self._scorer()
        futures = [scorer.score_labels(job) for job in plan.jobs]
        return plan.result([f.result() for f in futures])

    async def adecide(self, request: DecisionRequest) -> DecisionResult:
        """Async :meth:`decide`: rendering and tokenizing on a worker thread, scoring on the backend's."""
        plan = await asyncio.to_thread(self.plan, request)
        scorer = self._scorer()
        futures = [asyncio.wrap_future(scorer.score_labels(job)) for job in plan.jobs]
        return plan.result(list(await asyncio.gather(*futures)))


_deciders: weakref.WeakKeyDictionary[Any, LocalDecider] = weakref.WeakKeyDictionary()


def local_decider(runtime: ExLlamaRuntime) -> LocalDecider:
    """The decider of an in-process runtime (one per runtime)."""
    found = _deciders.get(runtime)
    if found is None:
        found = _deciders[runtime] = LocalDecider(runtime)
    return found


__all__ = ["DecisionPlan", "LocalDecider", "local_decider", "refuse_box"]
