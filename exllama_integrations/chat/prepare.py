"""A chat call, prepared once for every front door (LangChain, LlamaIndex, the HTTP server), over any Runtime.

:func:`prepare_chat`: a :class:`ChatRequest` (messages in Hugging Face conventions, OpenAI tool specs,
``tool_choice``, ``response_format``, template variables, settings) -> a
:class:`~exllama_integrations.contract.api.GenerationRequest`. Tools go to the template when it renders
them, else into the system turn with the history in the documented fallback (:mod:`.history`); a forced
``tool_choice`` becomes a grammar for exactly one well-formed call; a JSON reply becomes a strict
JSON-schema grammar. A reasoning model (:mod:`.reasoning`) thinks first: the grammar applies after its
thinking block, and ``max_reasoning_tokens`` bounds the block. What comes back is finished in :mod:`.outcome`.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import json
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..contract.api import GenerationRequest, Grammar, Media, Reasoning, check_depth
from ..contract.settings import GenerationSettings
from ..errors import ConstraintError, InvalidSettingsError, MediaError
from .formats import FALLBACK, FORMATS, ToolFormat, check_names, find_format, forced_call_grammar, strict_schema
from .history import (
    RESPONSE_CLOSE,
    RESPONSE_OPEN,
    TOOL_CLOSE,
    TOOL_OPEN,
    add_system_note,
    fallback_history,
    family_ids,
    literal_prompt_ids,
    native_history,
)
from .reasoning import find_reasoning, generation_prompt, open_block, tags_reasoning, turn_reasoning

if TYPE_CHECKING:
    from ..contract.api import Runtime

FALLBACK_TOOL_PROMPT = (
    "You can call these tools. To call one, reply with only\n"
    f'{TOOL_OPEN}{{"name": <tool name>, "arguments": <arguments as a JSON object>}}{TOOL_CLOSE}\n'
    "Tools:\n{tools}"
)
RENDERER_ARGUMENTS = frozenset({"messages", "tools", "add_generation_prompt", "chat_template", "documents"})
"""Names the renderer passes itself: a ``chat_template_kwargs`` key may not be one of them."""


@dataclass(frozen=True)
class ChatRequest:
    """One chat call as plain data, whatever framework it came from."""

    messages: Sequence[Mapping[str, Any]]
    """Hugging Face conventions: ``{"role", "content"}``; assistant ``tool_calls`` as OpenAI's
    ``[{"id", "type": "function", "function": {"name", "arguments"}}]`` and earlier thinking as
    ``reasoning_content`` (the template keeps or strips it); results as ``{"role": "tool", "content",
    "tool_call_id"}``. Rendered natively or through the fallback, as the template allows."""
    settings: GenerationSettings = field(default_factory=GenerationSettings)
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
    reasoning_tags: tuple[str, str] | None = None
    """A reasoning model's delimiters, where its template does not show them (default: found in the template)."""
    media: Sequence[Media] = ()
    """Images the messages refer to, in order."""
    tool_format: str | None = None
    """The family's tool-call format by name (``chat.formats.FORMATS``), where the template does not show it."""
    parallel_tool_calls: bool | None = None
    """False: at most one call in a reply (in the forced grammar and in what is read back)."""
    max_tool_calls: int | None = None
    """Most calls of a reply handed out (the Responses API's ``max_tool_calls``); the model's further calls are
    ignored, as OpenAI ignores them."""


@dataclass(frozen=True)
class PreparedChat:
    """What to generate for one chat call, and what its reply is read for."""

    request: GenerationRequest
    tools: tuple[Mapping[str, Any], ...] = ()
    """The tools shown to the model; when any are, its output is read for calls in ``format``."""
    format: ToolFormat = FORMATS[FALLBACK]
    """The family's tool-call format the reply is read in."""
    parallel: bool = True
    """Whether several calls of one reply are all kept (``parallel_tool_calls``)."""
    forced: bool = False
    """Whether ``tool_choice`` forces calls (the grammar writes them: their arguments stream as they come)."""
    max_calls: int | None = None
    """Most calls of the reply handed out (``max_tool_calls``); None: no bound."""

    @property
    def prompt(self) -> str | tuple[int, ...]:
        """What the model is given: prompt text, or token ids when message text was encoded literally."""
        return self.request.prompt

    @property
    def tools_active(self) -> bool:
        """Whether the reply is parsed for tool calls."""
        return bool(self.tools)

    @property
    def grammar(self) -> Grammar | None:
        """The grammar the answer is held to."""
        return self.request.grammar


def forced_tools(tools: Sequence[Mapping[str, Any]], tool_choice: Any) -> list[Mapping[str, Any]] | None:
    """The tools a tool_choice forces a call to (None: the model decides; []: no tools).

    Takes OpenAI's shapes (``"auto"``, ``"none"``, ``"required"``, ``{"type": "function", "function": {"name"}}``),
    Anthropic's (``{"type": "auto" | "any" | "none"}``, ``{"type": "tool", "name"}``), a tool's name, and
    ``{"type": "function", "function": NAME}`` (the name given bare: it means the same).

    Raises:
        InvalidSettingsError: a ``tool_choice`` of another shape, or one that names no bound tool.
    """
    if isinstance(tool_choice, Mapping) and tool_choice.get("type") in ("auto", "any", "required", "none"):
        tool_choice = tool_choice["type"]  # Anthropic's shape of the four
    if tool_choice in (None, "auto"):
        return None
    if tool_choice in ("none", False):
        return []
    if tool_choice in ("any", "required", True):
        return list(tools)
    name = tool_choice
    if isinstance(tool_choice, Mapping):
        function = tool_choice.get("function")
        # {"function": {"name": N}} (OpenAI's), {"function": N} (a common slip: meant the same), {"name": N}
        name = function.get("name") if isinstance(function, Mapping) else function or tool_choice.get("name")
    bound = [t["function"]["name"] for t in tools]
    if not isinstance(name, str):
        raise InvalidSettingsError(
            f"tool_choice {_short(tool_choice)} is not one of 'auto', 'none', 'required', a tool's name or "
            f'{{"type": "function", "function": {{"name": ...}}}}; bound tools: {bound}.',
            param="tool_choice",
        )
    chosen = [t for t in tools if t["function"]["name"] == name]
    if not chosen:
        raise InvalidSettingsError(
            f"tool_choice {_short(tool_choice)} names no bound tool; bound: {bound}.", param="tool_choice"
        )
    return chosen


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def reply_schema(response_format: Mapping[str, Any] | None) -> tuple[bool, dict[str, Any] | None]:
    """Whether ``response_format`` asks for JSON, and its schema (None: any JSON object).

    Raises:
        InvalidSettingsError: a malformed ``response_format``.
    """
    if response_format is None:
        return False, None
    if not isinstance(response_format, Mapping):
        raise InvalidSettingsError(
            "response_format must be a dict like {'type': 'json_schema', ...}.", param="response_format"
        )
    kind = response_format.get("type")
    if kind in (None, "text"):
        return False, None
    if kind == "json_object":
        return True, None
    if kind == "json_schema":
        js = response_format.get("json_schema") or {}
        schema = js.get("schema", js) if isinstance(js, Mapping) else None
        if not isinstance(schema, Mapping):
            raise InvalidSettingsError(
                "response_format.json_schema.schema must be a JSON schema object.", param="response_format"
            )
        return True, dict(schema)
    raise InvalidSettingsError(
        f"response_format type must be text, json_schema or json_object, not {kind!r}.", param="response_format"
    )


def _schema_instructions(schema: Mapping[str, Any] | None) -> str:
    """What the model is told about the JSON it must write (the grammar enforces it; words make it likely)."""
    if schema is None:
        return "Reply with a JSON object."
    return "Reply with a JSON object that follows this JSON schema:\n" + json.dumps(schema, ensure_ascii=False)


def _check_template_kwargs(kwargs: Mapping[str, Any]) -> None:
    clash = sorted(RENDERER_ARGUMENTS & set(kwargs))
    if clash:
        raise InvalidSettingsError(
            f"chat_template_kwargs may not set {', '.join(clash)}: the renderer passes those itself "
            "(give messages and tools as the call's own arguments).",
            param="chat_template_kwargs",
        )


def prepare_chat(runtime: Runtime, request: ChatRequest) -> PreparedChat:
    """Render a chat call and build its request (see the module docstring).

    Raises:
        InvalidSettingsError: bad tool_choice, response_format or chat_template_kwargs.
        ConstraintError: a schema that cannot be turned into a grammar.
        ChatTemplateError: the template failed.
    """
    _check_template_kwargs(request.template_kwargs)
    tools = list(request.tools or ())
    forced = forced_tools(tools, request.tool_choice) if tools else None
    shown = tools if tools and forced != [] else []
    wants_json, schema = reply_schema(request.response_format)
    grammar: Grammar | None = None
    messages: list[dict[str, Any]] = [dict(m) for m in request.messages]
    check_depth(tools, "the tools' schemas")
    check_depth(schema)
    info = runtime.model_info()
    native = info.renders_tools if request.chat_template is None else "tools" in request.chat_template
    if request.tool_format is not None:
        fmt = find_format(None, request.tool_format)
    elif not native:
        fmt = FORMATS[FALLBACK]  # the fallback prompt asks for this format
    elif request.chat_template is not None:
        fmt = find_format(request.chat_template)
    else:
        # the model's own response_template, where it ships one, reads the reply (its family's entry writes calls)
        spec = info.details.get("response_template")
        fmt = find_format(None, info.tool_format, spec) if info.tool_format else FORMATS[FALLBACK]
    parallel = request.parallel_tool_calls is not False
    check_names(fmt, shown)
    try:
        if forced:
            # a named tool is one call; "required" may be several where the family and parallel_tool_calls allow
            several = parallel and request.tool_choice in ("any", "required", True)
            # and no more than max_tool_calls: the model writes no call that nobody receives
            grammar = Grammar.lark(
                forced_call_grammar(
                    fmt, forced, _token_of(runtime), several, info.eos_token_ids, most=request.max_tool_calls
                )
            )
        elif wants_json:
            grammar = Grammar.json_schema(strict_schema(schema) if schema is not None else {"type": "object"})
            messages = add_system_note(messages, _schema_instructions(schema))
    except RecursionError:
        raise ConstraintError("the schema is nested too deeply to compile; flatten it.") from None
    if request.media and not info.accepts_images:  # before rendering: a text model's template reads text only
        why = info.details.get("vision") or "it has no vision component"
        raise MediaError(f"{info.name!r} takes no images: {why}; send text only.")
    reasoning = tags_reasoning(request.reasoning_tags)
    if reasoning is None:
        reasoning = find_reasoning(request.chat_template) if request.chat_template is not None else info.reasoning
    settings = request.settings
    if grammar is not None and settings.stop:
        settings = settings.model_copy(update={"stop": []})  # with a grammar, the grammar decides where output ends
    media = tuple(request.media)
    reply = _Reply(tuple(shown), fmt, parallel, bool(forced), request.max_tool_calls)
    if request.prompt is not None:
        turn = turn_reasoning(reasoning, request.prompt[-256:], settings.max_reasoning_tokens)
        return _prepared(request.prompt, settings, grammar, turn, media, reply)
    messages = (
        native_history(family_ids(messages, fmt.ids), fmt.history_arguments == "json")
        if native
        else fallback_history(messages)
    )
    if shown and not native:
        specs = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in shown)
        messages = add_system_note(messages, FALLBACK_TOOL_PROMPT.replace("{tools}", specs))
    if not native and grammar is None and (shown or any(m.get("role") == "tool" for m in request.messages)):
        # in the fallback format tool results are our markup: the model must never write one itself
        settings = settings.model_copy(update={"stop": [*settings.stop, RESPONSE_OPEN, RESPONSE_CLOSE]})

    def render(msgs: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        return runtime.chat_prompt(
            msgs,
            tools=shown if (shown and native) else None,
            add_generation_prompt=add_generation_prompt,
            chat_template=request.chat_template,
            **dict(request.template_kwargs),
        )

    text = render(messages)
    turn = None
    if reasoning is not None:
        gen = generation_prompt(lambda add: render(messages, add), text)
        turn = turn_reasoning(reasoning, gen, settings.max_reasoning_tokens)
    opening = ""
    if turn is not None and grammar is not None and not turn.started:
        opening, turn = open_block(turn)  # the model thinks first; the grammar holds its answer
    if request.split_special_tokens:
        ids = literal_prompt_ids(runtime, messages, render)
        if ids is not None:
            ids += runtime.encode(opening) if opening else []
            return _prepared(ids, settings, grammar, turn, media, reply)
    return _prepared(text + opening, settings, grammar, turn, media, reply)


@dataclass(frozen=True)
class _Reply:
    """What a prepared chat's reply is read for: the tools shown, their family's format, parallel calls."""

    tools: tuple[Mapping[str, Any], ...]
    format: ToolFormat
    parallel: bool
    forced: bool
    max_calls: int | None = None


def _token_of(runtime: Runtime) -> Any:
    """The id of a text that is one token of the model (a family's markup token), else None."""

    def token_of(text: str) -> int | None:
        ids = runtime.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    return token_of


def _prepared(
    prompt: str | list[int],
    settings: GenerationSettings,
    grammar: Grammar | None,
    reasoning: Reasoning | None,
    media: tuple[Media, ...],
    reply: _Reply,
) -> PreparedChat:
    # the family's markup and thinking delimiters show in the output even where they are special tokens
    show = reply.format.markup if reply.tools else ()
    if reasoning is not None:
        show = tuple(dict.fromkeys((*show, reasoning.start, reasoning.end)))
    request = GenerationRequest(
        prompt if isinstance(prompt, str) else tuple(prompt),
        settings,
        grammar=grammar,
        add_special_tokens=False,  # a template's text carries its own BOS
        reasoning=reasoning,
        media=media,
        show_tokens=show,
    )
    return PreparedChat(request, reply.tools, reply.format, reply.parallel, reply.forced, reply.max_calls)


_RENDERERS = ThreadPoolExecutor(max_workers=16, thread_name_prefix="exllama-render")
"""Where coroutines render chat templates: threads that outlive an event loop (``asyncio.to_thread`` would use
the loop's own executor, which ``asyncio.run``, as in ``ChatExLlama.batch()``, starts and joins every call: 3 of
the ~12 ms before a batch of 16 reached the backend on a 2-core CPU). Started as needed, up to 16 renders at once
(each bounded by the template sandbox's time budget)."""


async def aprepare_chat(runtime: Runtime, request: ChatRequest) -> PreparedChat:
    """:func:`prepare_chat` from a coroutine, on a thread (the caller's context, for tracing).

    A template's rendering time is not bounded by the conversation's length (a custom template may loop),
    so it never runs on the event loop.
    """
    ctx = contextvars.copy_context()
    return await asyncio.get_running_loop().run_in_executor(_RENDERERS, ctx.run, prepare_chat, runtime, request)


def with_incremental(prepared: PreparedChat, incremental: bool) -> GenerationRequest:
    """The prepared request, read incrementally or as a whole completion."""
    request = prepared.request
    return request if request.incremental == incremental else dataclasses.replace(request, incremental=incremental)


__all__ = [
    "FALLBACK_TOOL_PROMPT",
    "ChatRequest",
    "PreparedChat",
    "aprepare_chat",
    "forced_tools",
    "prepare_chat",
    "reply_schema",
    "with_incremental",
]
