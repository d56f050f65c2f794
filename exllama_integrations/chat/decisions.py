"""The chat each decision question becomes: a system turn, then one user turn of the state and the question.

Every door (the LangChain class, ``/v1/decisions``, the LlamaIndex selector) asks through this one layout, so a
question reads the same to the model wherever it comes from. The model's chat template renders it with its
generation prompt, and the answer's labels are scored as the first tokens of the assistant's reply::

    system:  You judge the input you are given and answer the question about it with one of the allowed
             answers, exactly as written, and nothing else.
    user:    Input:
             <the state>

             Question: <instructions>
             <the options, when they have descriptions; a score's numbered levels>
             Answer with exactly one of: <labels, comma-separated>.
    assistant: <label>

A Noul's labels are ``yes`` and ``no`` (its criteria as "Answer yes if: ..."); a Score's are its levels' numbers,
0 first. Everything before ``Question:`` is the same for every question about one state: a backend reads it once.
"""

from __future__ import annotations

from typing import Any

from ..contract.decisions import Noul, Question, Score

SYSTEM = (
    "You judge the input you are given and answer the question about it with one of the allowed answers, "
    "exactly as written, and nothing else."
)
QUESTION_MARK = "Question: "
"""Where a question's own text starts in the user turn (what precedes it is shared by every question)."""


def question_text(question: Question) -> str:
    """The question as the user turn writes it after the state (from ``Question:`` on)."""
    lines = [QUESTION_MARK + question.instructions.strip()]
    if isinstance(question, Noul):
        if question.yes:
            lines.append(f"Answer yes if: {question.yes}")
        if question.no:
            lines.append(f"Answer no if: {question.no}")
    elif isinstance(question, Score):
        lines.append("Levels:")
        lines.extend(
            f"{i}: {level.text}" + (f" ({level.description})" if level.description else "")
            for i, level in enumerate(question.levels)
        )
    elif any(label.description for label in question.labels):
        lines.append("Options:")
        lines.extend(
            f"- {label.text}" + (f": {label.description}" if label.description else "") for label in question.labels
        )
    allowed = ", ".join(label.text for label in question.labels)
    lines.append(f"Answer with exactly one of: {allowed}.")
    return "\n".join(lines)


def decision_messages(state: str, question_part: str) -> list[dict[str, Any]]:
    """The chat for one question (``question_part``: :func:`question_text`, or a marker to find the shared part)."""
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Input:\n{state}\n\n{question_part}"},
    ]


def plain_prompt(state: str, question_part: str) -> str:
    """The same layout for a model without a chat template: plain text ending in ``Answer:``.

    A label then reads as its own word, its space first.
    """
    return f"{SYSTEM}\n\nInput:\n{state}\n\n{question_part}\nAnswer:"


__all__ = ["QUESTION_MARK", "SYSTEM", "decision_messages", "plain_prompt", "question_text"]
