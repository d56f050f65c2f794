"""Decision questions and answers as contract values, and the label scoring a backend does for them.

A :class:`DecisionRequest` asks named questions about one state (the text the model reads): a :class:`Noul` (the
probability that the answer is yes), a :class:`Choice` (one label among options, with the distribution over all of
them) or a :class:`Score` (an expected level on an ordered rubric); a :class:`Box` (a place in an image) is refused
by every runtime here, typed. A :class:`DecisionResult` holds one answer per question, in order, the tokens read
and the prompt each question became.

The answers are read from the model's logits, never generated: a backend with the :class:`ScoresLabels`
capability computes, for a :class:`LabelScoring` (a prefix read once, then each question's own tokens, then each
label's tokens), each label's full log-probability. :func:`distribution` turns a question's label log-probabilities
into probabilities (a softmax over the labels, in float64) and :func:`confidence` says how concentrated they are.

:class:`Decides` is the optional runtime capability (``decide`` / ``adecide``), a protocol of its own beside
:class:`~.api.Runtime`, so a runtime without it stays a Runtime.

Example:
    >>> r = DecisionRequest("I was charged twice.", (Choice("team", "Who handles this?", labels("billing", "tech")),))
    >>> [label.text for label in r.questions[0].labels]
    ['billing', 'tech']
    >>> [round(p, 3) for p in distribution([-0.1, -2.4])]
    [0.909, 0.091]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

from ..errors import InvalidSettingsError

MAX_QUESTIONS = 64
"""Most questions one request may ask."""
MAX_LABELS = 256
"""Most labels (or levels) one question may offer."""
MAX_LEVELS = 10
"""Most levels of a Score: they are scored as the digits 0 to 9 (one token each)."""


def _bad(message: str, param: str) -> InvalidSettingsError:
    return InvalidSettingsError(message, param=param, reason="invalid_question")


@dataclass(frozen=True)
class Label:
    """One option of a Choice (or level of a Score): its value and what it means.

    ``value`` is what the answer names (text, or a boolean as OpenAI's Decisions API allows: read and written as
    ``true``/``false``); ``description`` says when it applies.
    """

    value: str | bool
    description: str | None = None

    @property
    def text(self) -> str:
        """The label as the model reads and answers it."""
        if isinstance(self.value, bool):
            return "true" if self.value else "false"
        return self.value


def labels(*values: str | bool) -> tuple[Label, ...]:
    """Labels without descriptions."""
    return tuple(Label(v) for v in values)


@dataclass(frozen=True)
class Noul:
    """Is it so? The answer is P(yes), renormalised over the labels ``yes`` and ``no``.

    ``yes`` / ``no``: what counts as each outcome (LangChain's ``NoulCriteria``), shown to the model when given.
    """

    name: str
    instructions: str
    yes: str | None = None
    no: str | None = None

    kind: ClassVar[str] = "noul"

    @property
    def labels(self) -> tuple[Label, ...]:
        """The two outcomes, yes first."""
        return (Label("yes", self.yes), Label("no", self.no))


@dataclass(frozen=True)
class Choice:
    """Which one? The answer is the distribution over ``labels`` (each scored by all its tokens) and the likeliest."""

    name: str
    instructions: str
    labels: tuple[Label, ...]

    kind: ClassVar[str] = "choice"


@dataclass(frozen=True)
class Score:
    """How much? ``levels`` are ordered from 0; the answer is the expected level under their distribution."""

    name: str
    instructions: str
    levels: tuple[Label, ...]

    kind: ClassVar[str] = "score"

    @property
    def labels(self) -> tuple[Label, ...]:
        """The levels as the model answers them: their numbers, 0 first."""
        return tuple(Label(str(i), level.text) for i, level in enumerate(self.levels))


@dataclass(frozen=True)
class Box:
    """Where in the image? Refused by every runtime here (see docs/decisions.md)."""

    name: str
    instructions: str

    kind: ClassVar[str] = "box"

    @property
    def labels(self) -> tuple[Label, ...]:
        """None: a place is not a label."""
        return ()


Question = Noul | Choice | Score | Box
QUESTION_KINDS: tuple[str, ...] = ("noul", "choice", "score", "box")


def _check_labels(q: Question, where: str) -> None:
    options = q.levels if isinstance(q, Score) else q.labels
    what = "levels" if isinstance(q, Score) else "labels"
    if not isinstance(options, tuple) or not options:
        raise _bad(f"{where} ({q.name!r}) has no {what}; give at least one.", f"{where}.{what}")
    if len(options) > MAX_LABELS:
        raise _bad(f"{where} ({q.name!r}) has {len(options)} {what}; at most {MAX_LABELS}.", f"{where}.{what}")
    if isinstance(q, Score) and not 2 <= len(options) <= MAX_LEVELS:
        raise _bad(
            f"{where} ({q.name!r}) has {len(options)} levels; a score takes 2 to {MAX_LEVELS} (scored as the digits "
            f"0 to {MAX_LEVELS - 1}).",
            f"{where}.levels",
        )
    seen: dict[str, int] = {}
    for i, label in enumerate(options):
        if not isinstance(label, Label) or not isinstance(label.value, (str, bool)):
            raise _bad(f"{where}.{what}[{i}] must be a Label of text or a boolean.", f"{where}.{what}")
        text = label.text.strip()
        if not text:
            raise _bad(f"{where}.{what}[{i}] is empty; a label needs text.", f"{where}.{what}")
        if text != label.text:
            raise _bad(f"{where}.{what}[{i}] ({label.text!r}) starts or ends with spaces; strip them.", where)
        key = text.casefold()
        if key in seen:
            raise _bad(
                f"{where} ({q.name!r}) has the {what[:-1]} {label.text!r} twice ({what}[{seen[key]}] and [{i}]); "
                f"each must differ (case aside).",
                f"{where}.{what}",
            )
        seen[key] = i


@dataclass(frozen=True)
class DecisionRequest:
    """Questions about one state, as a value: what the door (a framework class, ``/v1/decisions``) hands a runtime.

    ``state``: the text the model reads as the input (messages and JSON become text at the door, see
    docs/decisions.md). ``questions``: each with a name unique in the request.

    Raises:
        InvalidSettingsError: (400) an empty state; no questions, too many, or two of one name; a question with no
            instructions, no labels, two equal labels, or a score outside 2 to 10 levels.
    """

    state: str
    questions: tuple[Question, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.state, str) or not self.state.strip():
            raise _bad("the state (the input the questions are about) is empty; send some text.", "input")
        qs = self.questions
        if isinstance(qs, (str, bytes)) or not isinstance(qs, Sequence) or not qs:
            raise _bad("there are no questions; ask at least one.", "questions")
        object.__setattr__(self, "questions", tuple(qs))
        if len(qs) > MAX_QUESTIONS:
            raise _bad(f"{len(qs)} questions; at most {MAX_QUESTIONS} go in one request.", "questions")
        names: set[str] = set()
        for i, q in enumerate(self.questions):
            where = f"questions[{i}]"
            if not isinstance(q, (Noul, Choice, Score, Box)):
                raise _bad(
                    f"{where} is a {type(q).__name__}; a question is a Noul, Choice, Score or Box.", f"{where}.type"
                )
            if not isinstance(q.name, str) or not q.name:
                raise _bad(f"{where} has no name; each question needs one (its answer's key).", f"{where}.name")
            if q.name in names:
                raise _bad(f"two questions are named {q.name!r}; names key the answers, so each must differ.", where)
            names.add(q.name)
            if not isinstance(q.instructions, str) or not q.instructions.strip():
                raise _bad(f"{where} ({q.name!r}) has no instructions; say what to judge.", f"{where}.instructions")
            if not isinstance(q, (Noul, Box)):
                _check_labels(q, where)


@dataclass(frozen=True)
class NoulAnswer:
    """The probability that the answer to a Noul is yes."""

    name: str
    probability: float

    kind: ClassVar[str] = "noul"


@dataclass(frozen=True)
class ChoiceAnswer:
    """The likeliest label, every label's probability (in the question's order) and the confidence."""

    name: str
    choice: str | bool
    probabilities: tuple[tuple[str | bool, float], ...]
    confidence: float

    kind: ClassVar[str] = "choice"


@dataclass(frozen=True)
class ScoreAnswer:
    """The expected level, each level's probability (level 0 first), the rubric and the confidence."""

    name: str
    score: float
    probabilities: tuple[float, ...]
    legend: tuple[str, ...]
    confidence: float

    kind: ClassVar[str] = "score"


Answer = NoulAnswer | ChoiceAnswer | ScoreAnswer


@dataclass(frozen=True)
class DecisionResult:
    """One answer per question, in the request's order; the tokens the model read; the prompt each question became.

    ``prompt_tokens``: the request's positions, each counted once (the shared prefix once, each question's own tokens,
    and the label tokens after a label's first; a backend that computes some again, as exllamav3 does, counts them
    once); nothing is generated. ``prefix_tokens``: the part read once for all.
    """

    answers: tuple[Answer, ...]
    prompt_tokens: int
    model: str = ""
    prompts: tuple[str, ...] = ()
    prefix_tokens: int = 0


@dataclass(frozen=True)
class LabelBranch:
    """One question as a backend scores it: its own tokens after the shared prefix, then each label's tokens."""

    suffix: tuple[int, ...]
    labels: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class LabelScoring:
    """What a backend scores: ``prefix`` read once, then each branch's suffix on it, then each label on that.

    The answer (:meth:`ScoresLabels.score_labels`) is, per branch, each label's log-probability: the sum over its
    tokens of log p(token | prefix + suffix + the label's tokens before it), under the model's full distribution.
    """

    prefix: tuple[int, ...]
    branches: tuple[LabelBranch, ...]

    @property
    def tokens_read(self) -> int:
        """The job's positions, each once: the prefix, each suffix, and each label's tokens after its first."""
        labels_read = sum(len(lab) - 1 for b in self.branches for lab in b.labels)
        return len(self.prefix) + sum(len(b.suffix) for b in self.branches) + labels_read


LabelLogprobs = tuple[tuple[float, ...], ...]
"""Per branch, each label's log-probability (what :meth:`ScoresLabels.score_labels` answers)."""


@runtime_checkable
class ScoresLabels(Protocol):
    """Optional, for a backend: it scores labels from one prefill's logits, on its own thread."""

    def score_labels(self, job: LabelScoring) -> Future[LabelLogprobs]: ...


@runtime_checkable
class Decides(Protocol):
    """Optional, for a runtime: it answers decision questions."""

    def decide(self, request: DecisionRequest) -> DecisionResult: ...

    async def adecide(self, request: DecisionRequest) -> DecisionResult: ...


def distribution(logprobs: Sequence[float]) -> tuple[float, ...]:
    """The labels' probabilities: their log-probabilities' softmax, in float64 (they sum to 1 within 1e-15)."""
    top = max(logprobs)
    weights = [math.exp(lp - top) for lp in logprobs]
    total = math.fsum(weights)
    return tuple(w / total for w in weights)


def confidence(probabilities: Sequence[float]) -> float:
    """How concentrated a distribution is: 1 - its entropy / log(number of labels) (1: certain; 0: uniform)."""
    if len(probabilities) < 2:
        return 1.0
    entropy = -math.fsum(p * math.log(p) for p in probabilities if p > 0)
    return min(1.0, max(0.0, 1.0 - entropy / math.log(len(probabilities))))


def answer_of(question: Question, logprobs: Sequence[float]) -> Answer:
    """A question's answer from its labels' log-probabilities (in the order of ``question.labels``)."""
    p = distribution(logprobs)
    if isinstance(question, Noul):
        return NoulAnswer(question.name, p[0])
    if isinstance(question, Choice):
        best = max(range(len(p)), key=lambda i: (p[i], -i))
        pairs = tuple((label.value, p[i]) for i, label in enumerate(question.labels))
        return ChoiceAnswer(question.name, question.labels[best].value, pairs, confidence(p))
    if isinstance(question, Score):
        expected = math.fsum(i * pi for i, pi in enumerate(p))
        legend = tuple(level.text for level in question.levels)
        return ScoreAnswer(question.name, expected, p, legend, confidence(p))
    raise _bad(f"{question.kind} questions are not answered from labels.", "questions")


__all__ = [
    "MAX_LABELS",
    "MAX_LEVELS",
    "MAX_QUESTIONS",
    "QUESTION_KINDS",
    "Answer",
    "Box",
    "Choice",
    "ChoiceAnswer",
    "DecisionRequest",
    "DecisionResult",
    "Decides",
    "Label",
    "LabelBranch",
    "LabelLogprobs",
    "LabelScoring",
    "Noul",
    "NoulAnswer",
    "Question",
    "Score",
    "ScoreAnswer",
    "ScoresLabels",
    "answer_of",
    "confidence",
    "distribution",
    "labels",
]
