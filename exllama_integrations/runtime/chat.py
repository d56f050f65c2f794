"""A chat call, prepared once for every front door (LangChain, LlamaIndex, the HTTP server), over any Runtime.

:func:`prepare_chat`: messages (template dicts, Hugging Face conventions), tools (OpenAI function
specs), ``tool_choice`` and ``response_format`` -> the prompt and a :class:`~.api.Grammar`. Tools go
to the template when it renders them, else into the system turn with the history rewritten to the
documented fallback (calls as ``<tool_call>`` text, results as ``<tool_response>`` turns); a forced
``tool_choice`` becomes a grammar for exactly one well-formed call; a JSON reply becomes a strict
JSON-schema grammar. What comes back is finished in :mod:`.chat_outcome`.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import ConstraintError, InvalidSettingsError
from .api import Grammar
from .constraints import check_depth, strict_schema, tool_call_grammar

if TYPE_CHECKING:
    from .api import Runtime
    from .settings import GenerationSettings

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"

FALLBACK_TOOL_PROMPT = (
    "You can call these tools. To call one, reply with only\n"
    f'{TOOL_OPEN}{{"name": <tool name>, "arguments": <arguments as a JSON object>}}{TOOL_CLOSE}\n'
    "Tools:\n{tools}"
)


@dataclass(frozen=True)
class ChatRequest:
    """One chat call as plain data, whatever framework it came from."""

    messages: Sequence[Mapping[str, Any]]
    """Hugging Face conventions: ``{"role", "content"}``; assistant ``tool_calls`` as OpenAI's
    ``[{"id", "type": "function", "function": {"name", "arguments"}}]``; results as ``{"role": "tool",
    "content", "tool_call_id"}``. Rendered natively or through the fallback, as the template allows."""
    tools: Sequence[Mapping[str, Any]] = ()
    tool_choice: Any = None
    response_format: Mapping[str, Any] | None = None
    """OpenAI's: ``{"type": "json_schema", "json_schema": {"schema": {...}}}``, ``{"type": "json_object"}``."""
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    chat_template: str | None = None
    """A template to use instead of the model's own (rendered in the same sandbox)."""
    prompt: str | None = None
    """A prompt the caller formatted itself (LlamaIndex ``messages_to_prompt``): the template is skipped."""
    split_special_tokens: bool = False
    """Encode message text literally: special-token strings a user typed (``<|im_end|>``) stay text.
    By default (as in transformers) they become control tokens."""


@dataclass(frozen=True)
class PreparedChat:
    """What to generate for one chat call."""

    prompt: str | list[int]
    """Prompt text, or token ids when message text was encoded literally."""
    grammar: Grammar | None = None
    tools: tuple[Mapping[str, Any], ...] = ()
    """The tools shown to the model; when any are, ``<tool_call>`` output becomes tool calls."""

    @property
    def tools_active(self) -> bool:
        """Whether the reply is parsed for tool calls."""
        return bool(self.tools)

    def settings_for(self, settings: GenerationSettings) -> GenerationSettings:
        """``settings`` for this chat: with a grammar, the grammar decides where output ends, not stops."""
        if self.grammar is not None and settings.stop:
            return settings.model_copy(update={"stop": []})
        return settings


def tool_call_text(name: str, arguments: Mapping[str, Any]) -> str:
    """A tool call written the way the fallback format asks the model to write it."""
    return f"{TOOL_OPEN}{json.dumps({'name': name, 'arguments': dict(arguments)}, ensure_ascii=False)}{TOOL_CLOSE}"


def tool_response_text(content: str) -> str:
    """A tool result as the fallback format shows it to the model (in a user turn)."""
    return f"<tool_response>\n{content}\n</tool_response>"


def add_system_note(messages: Sequence[Mapping[str, Any]], note: str) -> list[dict[str, Any]]:
    """Append ``note`` to the system turn, adding one if there is none."""
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
        out[0]["content"] = (out[0].get("content") or "") + "\n\n" + note
        return out
    return [{"role": "system", "content": note}, *out]


def forced_tools(tools: Sequence[Mapping[str, Any]], tool_choice: Any) -> list[Mapping[str, Any]] | None:
    """The tools a tool_choice forces a call to (None: the model decides; []: no tools).

    Raises:
        InvalidSettingsError: ``tool_choice`` names no bound tool.
    """
    if tool_choice in (None, "auto"):
        return None
    if tool_choice in ("none", False):
        return []
    if tool_choice in ("any", "required", True):
        return list(tools)
    name = tool_choice
    if isinstance(tool_choice, Mapping):
        name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
    chosen = [t for t in tools if t["function"]["name"] == name]
    if not chosen:
        raise InvalidSettingsError(
            f"tool_choice {tool_choice!r} names no bound tool; bound: {[t['function']['name'] for t in tools]}."
        )
    return chosen


def reply_schema(response_format: Mapping[str, Any] | None) -> tuple[bool, dict[str, Any] | None]:
    """Whether ``response_format`` asks for JSON, and its schema (None: any JSON object).

    Raises:
        InvalidSettingsError: a malformed ``response_format``.
    """
    if response_format is None:
        return False, None
    if not isinstance(response_format, Mapping):
        raise InvalidSettingsError("response_format must be a dict like {'type': 'json_schema', ...}.")
    kind = response_format.get("type")
    if kind in (None, "text"):
        return False, None
    if kind == "json_object":
        return True, None
    if kind == "json_schema":
        js = response_format.get("json_schema") or {}
        schema = js.get("schema", js) if isinstance(js, Mapping) else None
        if not isinstance(schema, Mapping):
            raise InvalidSettingsError("response_format.json_schema.schema must be a JSON schema object.")
        return True, dict(schema)
    raise InvalidSettingsError(f"response_format type must be text, json_schema or json_object, not {kind!r}.")


def _schema_instructions(schema: Mapping[str, Any] | None) -> str:
    """What the model is told about the JSON it must write (the grammar enforces it; words make it likely)."""
    if schema is None:
        return "Reply with a JSON object."
    return "Reply with a JSON object that follows this JSON schema:\n" + json.dumps(schema, ensure_ascii=False)


def fallback_history(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A history for a template that renders no tools (the documented fallback).

    Calls become ``<tool_call>`` text in the assistant turn, results ``<tool_response>`` user turns.
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


def native_history(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A history for a template that renders tools: tool-call arguments as objects, as templates expect."""
    out = []
    for m in messages:
        d = dict(m)
        if d.get("tool_calls"):
            d["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": _arguments(c["function"])}} for c in d["tool_calls"]
            ]
        out.append(d)
    return out


def prepare_chat(runtime: Runtime, request: ChatRequest) -> PreparedChat:
    """Render a chat call and build its grammar (see the module docstring).

    Raises:
        InvalidSettingsError: bad tool_choice or response_format.
        ConstraintError: a schema that cannot be turned into a grammar.
        ChatTemplateError: the template failed.
    """
    tools = list(request.tools or ())
    forced = forced_tools(tools, request.tool_choice) if tools else None
    shown = tools if tools and forced != [] else []
    wants_json, schema = reply_schema(request.response_format)
    grammar: Grammar | None = None
    messages: list[dict[str, Any]] = [dict(m) for m in request.messages]
    check_depth(tools, "the tools' schemas")
    check_depth(schema)
    try:
        if forced:
            grammar = Grammar.lark(tool_call_grammar(forced, TOOL_OPEN, TOOL_CLOSE))
        elif wants_json:
            grammar = Grammar.json_schema(strict_schema(schema) if schema is not None else {"type": "object"})
            messages = add_system_note(messages, _schema_instructions(schema))
    except RecursionError:
        raise ConstraintError("the schema is nested too deeply to compile; flatten it.") from None
    if request.prompt is not None:
        return PreparedChat(request.prompt, grammar, tuple(shown))
    native = runtime.model_info().renders_tools if request.chat_template is None else "tools" in request.chat_template
    messages = native_history(messages) if native else fallback_history(messages)
    if shown and not native:
        specs = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in shown)
        messages = add_system_note(messages, FALLBACK_TOOL_PROMPT.replace("{tools}", specs))

    def render(msgs: list[dict[str, Any]]) -> str:
        return runtime.chat_prompt(
            msgs,
            tools=shown if (shown and native) else None,
            chat_template=request.chat_template,
            **dict(request.template_kwargs),
        )

    if request.split_special_tokens:
        ids = literal_prompt_ids(runtime, messages, render)
        if ids is not None:
            return PreparedChat(ids, grammar, tuple(shown))
    return PreparedChat(render(messages), grammar, tuple(shown))


_SENTINEL = re.compile("\ue000(\\d+)\ue001")


def literal_prompt_ids(runtime: Runtime, messages: list[dict[str, Any]], render: Any) -> list[int] | None:
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


async def aprepare_chat(runtime: Runtime, request: ChatRequest) -> PreparedChat:
    """:func:`prepare_chat` from a coroutine, on a thread.

    A template's rendering time is not bounded by the conversation's length (a custom template may loop),
    so it never runs on the event loop.
    """
    return await asyncio.to_thread(prepare_chat, runtime, request)
