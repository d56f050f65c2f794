"""A chat history as the template will see it: tool calls and results natively, or in the documented fallback.

A template that renders ``tools`` gets OpenAI-style tool calls with their arguments as objects; any other
gets the fallback: calls written as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the
assistant's turn and results as ``<tool_response>`` user turns, the last of them followed by
:data:`ANSWER_NOTE` (without it small models copy the markup instead of answering).
:func:`literal_prompt_ids` encodes message text literally (special-token strings a user typed stay text).
"""

from __future__ import annotations

import hashlib
import json
import re
import string
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..contract.api import Runtime

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
_ALNUM = string.ascii_letters + string.digits
ANSWER_NOTE = "Now answer the question in plain words using these results."
"""What follows the tool results that end a fallback-format history: the model's turn is to answer."""


def tool_call_text(name: str, arguments: Mapping[str, Any]) -> str:
    """A tool call written the way the fallback format asks the model to write it."""
    return f"{TOOL_OPEN}{json.dumps({'name': name, 'arguments': dict(arguments)}, ensure_ascii=False)}{TOOL_CLOSE}"


def tool_response_text(content: str) -> str:
    """A tool result as the fallback format shows it to the model (in a user turn)."""
    return f"{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}"


def add_system_note(messages: Sequence[Mapping[str, Any]], note: str) -> list[dict[str, Any]]:
    """Append ``note`` to the system turn, adding one if there is none."""
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
        out[0]["content"] = (out[0].get("content") or "") + "\n\n" + note
        return out
    return [{"role": "system", "content": note}, *out]


def fallback_history(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A history for a template that renders no tools (the documented fallback).

    Calls become ``<tool_call>`` text in the assistant turn, results ``<tool_response>`` user turns; a
    history that ends on results ends with :data:`ANSWER_NOTE`.
    """
    out: list[dict[str, Any]] = []
    for m in messages:
        d = dict(m)
        calls = d.pop("tool_calls", None) or []
        if d.get("role") == "assistant" and calls:
            text = d.get("content") or ""
            written = "".join(tool_call_text(c["function"]["name"], _arguments(c["function"])) for c in calls)
            d["content"] = (text + "\n" if text else "") + written
        elif d.get("role") == "tool":
            d = {"role": "user", "content": tool_response_text(d.get("content") or "")}
        out.append(d)
    if messages and messages[-1].get("role") == "tool":
        out[-1]["content"] += "\n" + ANSWER_NOTE
    return out


def _arguments(function: Mapping[str, Any]) -> dict[str, Any]:
    args = function.get("arguments")
    if isinstance(args, Mapping):
        return dict(args)
    try:
        value = json.loads(args or "{}")
    except (json.JSONDecodeError, TypeError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def family_ids(messages: Sequence[Mapping[str, Any]], style: str) -> list[dict[str, Any]]:
    """The history with its call ids in the family's style (``alnum9``, ``kimi``; others as they are).

    ``alnum9``: Mistral's templates refuse any other; ``kimi``: ``functions.NAME:N``, which Kimi's template shows in
    place of the name. An id another client made (``call_...``) becomes 9 letters and digits derived from it, the
    same in the assistant's call and in the tool result that answers it, so the pair still matches.
    """
    out = [dict(m) for m in messages]
    if style == "kimi":
        return _kimi_ids(out)
    if style != "alnum9":
        return out

    def nine(cid: Any) -> Any:
        if not isinstance(cid, str) or (len(cid) == 9 and cid.isalnum()):
            return cid
        digest = hashlib.sha256(cid.encode("utf-8", "surrogatepass")).digest()
        return "".join(_ALNUM[b % len(_ALNUM)] for b in digest[:9])

    for d in out:
        if d.get("tool_calls"):
            d["tool_calls"] = [{**c, "id": nine(c.get("id"))} for c in d["tool_calls"]]
        if d.get("role") == "tool" and "tool_call_id" in d:
            d["tool_call_id"] = nine(d["tool_call_id"])
    return out


def _kimi_ids(out: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Kimi's ids: ``functions.NAME:N``, N counting the conversation's calls (its template shows the id)."""
    given: dict[Any, str] = {}
    for d in out:
        calls = []
        for c in d.get("tool_calls") or []:
            name = (c.get("function") or {}).get("name", "")
            new = given.setdefault(c.get("id"), f"functions.{name}:{len(given)}")
            calls.append({**c, "id": new})
        if calls:
            d["tool_calls"] = calls
        if d.get("role") == "tool" and d.get("tool_call_id") in given:
            d["tool_call_id"] = given[d["tool_call_id"]]
    return out


def native_history(messages: Sequence[Mapping[str, Any]], json_arguments: bool = False) -> list[dict[str, Any]]:
    """A history for a template that renders tools: tool-call arguments as objects, as templates expect.

    ``json_arguments``: as JSON text instead, for a template that writes them with ``+`` (DeepSeek-V3.1's).
    """
    out = []
    for m in messages:
        d = dict(m)
        if d.get("tool_calls"):
            d["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": _history_arguments(c["function"], json_arguments)}}
                for c in d["tool_calls"]
            ]
        out.append(d)
    return out


def _history_arguments(function: Mapping[str, Any], as_json: bool) -> Any:
    args = _arguments(function)
    return json.dumps(args, ensure_ascii=False) if as_json else args


_SENTINEL = re.compile("\ue000(\\d+)\ue001")


def literal_prompt_ids(
    runtime: Runtime, messages: list[dict[str, Any]], render: Callable[[list[dict[str, Any]]], str]
) -> list[int] | None:
    """The prompt's ids with each message's text encoded literally (special-token strings stay text).

    The template is rendered with a placeholder for each message's text; the template's own text is
    encoded as usual, the messages' text with ``parse_special=False``. None when the template does not
    keep the placeholders intact (it slices or rewrites message text): then the caller renders normally.
    """
    texts: list[str] = []
    marked = []
    for m in messages:
        if isinstance(m.get("content"), str) and m["content"]:
            texts.append(m["content"])
            m = {**m, "content": f"\ue000{len(texts) - 1}\ue001"}
        marked.append(m)
    rendered = render(marked)
    parts = _SENTINEL.split(rendered)
    if any("\ue000" in p or "\ue001" in p for p in parts[::2]) or any(int(n) >= len(texts) for n in parts[1::2]):
        return None
    ids: list[int] = []
    for i, part in enumerate(parts):
        if i % 2 == 0:
            ids += runtime.encode(part) if part else []
        else:
            ids += runtime.encode(texts[int(part)], parse_special=False)
    return ids
