"""The Decisions API's wire models: the request ``OpenAIDecisions`` and ``OpenAIClassifier`` send, and the answer.

A body has ``model``, ``input`` (text, or input items: messages whose content is text or ``input_text`` /
``input_json`` / ``input_image`` parts, ``function_call`` and ``function_call_output`` items) and ``questions``
(``predicate``, ``choice``, ``score``; our extensions: a predicate's ``criteria`` and a ``box`` question, refused
typed). Unknown fields and question types are refused (400, OpenAI's error shape). The answer's shape is built in
:mod:`...contract.decision_wire`; its ``metadata`` (our extension) holds the prompt each question became.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from ...contract.decisions import MAX_LABELS, MAX_QUESTIONS
from ..openai.protocol.common import Wire

Instructions = str | list[dict[str, Any]]
"""Text, or parts (``input_text``, ``input_json``; ``input_image`` is refused) as ``OpenAIClassifier`` sends."""


class CriteriaWire(Wire):
    """What counts as yes and as no (LangChain's ``NoulCriteria``; an extension of a predicate)."""

    true: str | None = None
    false: str | None = None


class PredicateWire(Wire):
    """Is it so? Answered with ``probability``, P(yes)."""

    type: Literal["predicate"]
    name: str = Field(min_length=1, max_length=256)
    instructions: Instructions
    criteria: CriteriaWire | None = None


class ChoiceOptionWire(Wire):
    """One option of a choice."""

    value: str | bool
    description: str | None = None


class ChoiceWire(Wire):
    """Which one? Answered with ``choice``, ``probabilities`` over every option and ``confidence``."""

    type: Literal["choice"]
    name: str = Field(min_length=1, max_length=256)
    instructions: Instructions
    choices: list[ChoiceOptionWire] = Field(max_length=MAX_LABELS)


class LevelWire(Wire):
    """One level of a score (levels are numbered from 0 in their order)."""

    label: str
    description: str | None = None


class ScoreWire(Wire):
    """How much? Answered with the expected level ``score``, ``probabilities`` per level and ``confidence``."""

    type: Literal["score"]
    name: str = Field(min_length=1, max_length=256)
    instructions: Instructions
    levels: list[LevelWire] = Field(max_length=MAX_LABELS)


class BoxWire(Wire):
    """Where in the image? (an extension, refused typed: see docs/decisions.md)."""

    type: Literal["box"]
    name: str = Field(min_length=1, max_length=256)
    instructions: Instructions


QuestionWire = Annotated[PredicateWire | ChoiceWire | ScoreWire | BoxWire, Field(discriminator="type")]


class DecisionBody(Wire):
    """A Decisions request (see the module docstring)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    questions: list[QuestionWire] = Field(max_length=MAX_QUESTIONS)


class DecisionResponse(BaseModel):
    """The Decisions answer: one answer per question, in order, by ``name``; ``usage``; our ``metadata``."""

    id: str
    object: Literal["decision"] = "decision"
    model: str
    answers: list[dict[str, Any]]
    usage: dict[str, Any]
    metadata: dict[str, Any]


__all__ = [
    "BoxWire",
    "ChoiceOptionWire",
    "ChoiceWire",
    "CriteriaWire",
    "DecisionBody",
    "DecisionResponse",
    "LevelWire",
    "PredicateWire",
    "QuestionWire",
]
