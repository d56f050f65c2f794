"""A Decisions body as the contract's request: the input as the text the model reads, the questions as values.

The input becomes text as OpenAI's own client makes state it cannot send natively: text stays text; user
messages of text are their texts, a blank line apart; anything else (other roles, tool calls and their outputs,
``input_json``) is the items as JSON text. Instructions given as parts are their text (``input_json`` as JSON
text). Images are refused, typed: decisions read text here.
"""

from __future__ import annotations

import json
from typing import Any

from ...contract.decision_wire import question_of
from ...contract.decisions import DecisionRequest
from ...errors import MediaError
from .protocol import DecisionBody

IMAGE_PARTS = frozenset({"input_image", "image_url", "image"})


def _no_images(value: Any, where: str) -> None:
    stack = [value]
    while stack:  # without recursion: a body's depth is the client's
        item = stack.pop()
        if isinstance(item, dict):
            if item.get("type") in IMAGE_PARTS:
                raise MediaError(f"{where} holds an image; decisions read text only here, send text.", param=where)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _part_text(part: Any) -> str | None:
    if isinstance(part, dict) and part.get("type") in ("input_text", "text") and isinstance(part.get("text"), str):
        return str(part["text"])
    if isinstance(part, dict) and part.get("type") == "input_json":
        return json.dumps(part.get("data"), ensure_ascii=False)
    return None


def content_text(content: Any) -> str | None:
    """A message's content as text (None: it holds something other than text and JSON parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [_part_text(p) for p in content]
        if all(t is not None for t in texts):
            return "".join(t for t in texts if t is not None)
    return None


def input_text(value: str | list[dict[str, Any]]) -> str:
    """The state the model reads (see the module docstring)."""
    if isinstance(value, str):
        return value
    _no_images(value, "input")
    texts = [content_text(item.get("content")) if item.get("role") == "user" else None for item in value]
    if value and all(t is not None for t in texts):
        return "\n\n".join(t for t in texts if t is not None)
    items = [{**item, "content": content_text(item["content"])} if "content" in item else item for item in value]
    return json.dumps(items, ensure_ascii=False)


def instructions_text(value: str | list[dict[str, Any]], where: str) -> str:
    """A question's instructions as text."""
    if isinstance(value, str):
        return value
    _no_images(value, where)
    return content_text(value) or ""


def to_request(body: DecisionBody) -> DecisionRequest:
    """The contract's request (typed 400s for what the contract refuses: see DecisionRequest)."""
    questions = []
    for i, q in enumerate(body.questions):
        item = q.model_dump(exclude_none=True)
        item["instructions"] = instructions_text(q.instructions, f"questions[{i}].instructions")
        questions.append(question_of(item))
    return DecisionRequest(input_text(body.input), tuple(questions))


__all__ = ["content_text", "input_text", "instructions_text", "to_request"]
