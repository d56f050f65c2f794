"""Anthropic's Messages API and the one chat: a request to the chat request, a finished reply to the Messages shapes.

:func:`to_chat` (a :class:`~..conversion.ToChat`): ``system`` becomes the system turn; text and image blocks (base64
or url sources, read by :mod:`~exllama_integrations.model.media`) a user turn's content; ``tool_use`` blocks the
assistant's tool calls and ``tool_result`` blocks tool turns answering them by id; ``thinking`` blocks the earlier
turn's reasoning; ``tools`` / ``tool_choice`` OpenAI's specs; ``thinking`` the reasoning budget
(``max_reasoning_tokens``) or ``enable_thinking=False`` for the template; ``output_config.format`` (structured
output) a JSON-schema reply held to it by a grammar.

A finished reply's calls, stop reason and usage are decided once for the whole answer (:func:`message_of`) and the
stream (:mod:`.stream`). Calls are the outcome's valid calls (the chat layer keeps only the first with
``disable_parallel_tool_use``); a call that did not read is not a call, its raw text stays text; one cut short by
``max_tokens`` is a ``tool_use`` block with its input as far as it got. ``stop_reason``: ``max_tokens`` when the
reply was cut, ``tool_use`` when it holds calls, ``stop_sequence`` when one of the request's ``stop_sequences``
ended it, else ``end_turn``. ``input_tokens`` are the prompt tokens computed, ``cache_read_input_tokens`` those
reused from the prefix cache (Anthropic counts the two apart).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ...chat.content import content_of
from ...chat.formats import partial_object
from ...chat.outcome import ChatOutcome, ParsedToolCall
from ...chat.prepare import ChatRequest
from ...contract.api import Media, Usage
from ...contract.settings import GenerationSettings, resolve_settings
from ...errors import InvalidSettingsError, MediaError
from ...model.media import MediaLimits, media_from_base64, media_from_url
from ..conversion import ChatContext
from .protocol import (
    ContentOut,
    CountTokensRequest,
    ImageBlock,
    ImageSource,
    MessageOut,
    MessageParam,
    MessagesRequest,
    RedactedThinkingBlock,
    StopReason,
    TextBlock,
    TextOut,
    ThinkingBlock,
    ThinkingOut,
    ToolChoice,
    ToolResultBlock,
    ToolSpec,
    ToolUseBlock,
    ToolUseOut,
    UsageOut,
)

# --------------------------------------------------------------------------- the request


def to_chat(body: MessagesRequest, context: ChatContext) -> ChatRequest:
    """The call as the plain-data chat request every front door uses (images read within ``context.media``).

    Raises:
        InvalidSettingsError: a tool_result that answers no call of the turn before it, or bad settings.
        MediaError: an image refused (or an image outside a user turn).
    """
    media: list[Media] = []
    messages: list[dict[str, Any]] = []
    system = body.system if isinstance(body.system, str) or body.system is None else _joined(body.system)
    if system:
        messages.append({"role": "system", "content": system})
    calls: dict[str, str] = {}  # the previous assistant turn's tool_use ids -> their tools' names
    for i, m in enumerate(body.messages):
        if m.role == "assistant":
            messages.append(_assistant_turn(m))
            calls = {c["id"]: c["function"]["name"] for c in messages[-1].get("tool_calls", ())}
        else:
            messages.extend(_user_turns(m, i, calls, media, context.media))
            calls = {}
    kwargs: dict[str, Any] = {}
    if body.thinking is not None and body.thinking.type != "adaptive":
        kwargs["enable_thinking"] = body.thinking.type == "enabled"
    tools = [_tool(t) for t in body.tools or ()]
    choice = _choice(body.tool_choice) if body.tool_choice is not None and tools else None
    single = body.tool_choice is not None and body.tool_choice.disable_parallel_tool_use
    form = body.output_config.format if body.output_config is not None else None
    form = form or body.output_format
    return ChatRequest(
        messages=messages,
        settings=_settings(body, context.defaults, context.refused, context.max_tokens),
        tools=tools,
        tool_choice=choice,
        response_format={"type": "json_schema", "json_schema": {"schema": form.schema_}} if form else None,
        parallel_tool_calls=False if single else None,
        template_kwargs=kwargs,
        chat_template=context.chat_template,
        media=media,
    )


def count_request(body: CountTokensRequest) -> MessagesRequest:
    """The prompt ``count_tokens`` counts, as a Messages request (``max_tokens`` 1: nothing is generated)."""
    return MessagesRequest(max_tokens=1, **body.model_dump(exclude_none=True, by_alias=True))


def _settings(
    body: MessagesRequest, defaults: GenerationSettings, refused: Mapping[str, str], max_tokens_cap: int | None
) -> GenerationSettings:
    """The request's settings over the server's defaults, resolved once.

    Raises:
        InvalidSettingsError: ``max_tokens`` over the server's cap (``serve --max-tokens``), or a setting
            the backend cannot honour.
    """
    if max_tokens_cap is not None and body.max_tokens > max_tokens_cap:
        raise InvalidSettingsError(
            f"max_tokens is {body.max_tokens}; this server allows at most {max_tokens_cap}.",
            param="max_tokens",
            reason="max_tokens_too_large",
        )
    budget = body.thinking.budget_tokens if body.thinking and body.thinking.type == "enabled" else None
    if body.thinking and body.thinking.type == "enabled" and budget is None:
        raise InvalidSettingsError("thinking of type enabled needs budget_tokens.", param="thinking.budget_tokens")
    values: dict[str, Any] = {
        "max_new_tokens": body.max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "stop": body.stop_sequences,
        "max_reasoning_tokens": budget,
    }
    return resolve_settings(defaults, refused, **{k: v for k, v in values.items() if v is not None})


def _tool(spec: ToolSpec) -> dict[str, Any]:
    """A tool as the OpenAI-style spec the chat layer takes."""
    function: dict[str, Any] = {"name": spec.name, "parameters": spec.input_schema}
    if spec.description:
        function["description"] = spec.description
    return {"type": "function", "function": function}


def _choice(choice: ToolChoice) -> Any:
    """OpenAI's tool_choice for the chat layer."""
    if choice.type == "tool":
        if not choice.name:
            raise InvalidSettingsError("tool_choice of type tool needs the tool's name.", param="tool_choice")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _media(source: ImageSource, limits: MediaLimits) -> Media:
    """An image source as the contract's value, read within ``limits``."""
    if source.type == "base64":
        if not source.data:
            raise MediaError("an image source of type base64 needs its data.", param="messages")
        return media_from_base64(source.data, source.media_type, limits)
    if not source.url:
        raise MediaError("an image source of type url needs its url.", param="messages")
    return media_from_url(source.url, limits)


def _result_text(block: ToolResultBlock) -> str:
    """A tool result as the text a tool turn carries (a failed tool's result says so)."""
    if block.content is None or isinstance(block.content, str):
        body = block.content or ""
    else:
        if any(isinstance(b, ImageBlock) for b in block.content):
            raise MediaError(
                "images in a tool_result are not taken here; send the image in a user turn's image block.",
                param="messages",
            )
        body = "\n".join(b.text for b in block.content if isinstance(b, TextBlock))
    return f"Error: {body}" if block.is_error else body


def _joined(blocks: list[TextBlock]) -> str:
    return "\n".join(b.text for b in blocks)


def _assistant_turn(m: MessageParam) -> dict[str, Any]:
    """An assistant turn in Hugging Face conventions: text, tool calls, earlier thinking."""
    if isinstance(m.content, str):
        return {"role": "assistant", "content": m.content}
    text, thought, calls = [], [], []
    for b in m.content:
        if isinstance(b, TextBlock):
            text.append(b.text)
        elif isinstance(b, ThinkingBlock):
            thought.append(b.thinking)
        elif isinstance(b, ToolUseBlock):
            calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}})
        elif not isinstance(b, RedactedThinkingBlock):
            raise InvalidSettingsError(
                f"an assistant turn takes text, thinking and tool_use blocks, not {b.type}.", param="messages"
            )
    d: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        d["tool_calls"] = calls
    if thought:
        d["reasoning_content"] = "\n".join(thought)
    return d


def _user_turns(
    m: MessageParam, i: int, calls: Mapping[str, str], media: list[Media], limits: MediaLimits
) -> list[dict[str, Any]]:
    """A user turn: its tool results first (one tool turn each, by the call they answer), then its text and images."""
    if isinstance(m.content, str):
        return [{"role": "user", "content": m.content}]
    out: list[dict[str, Any]] = []
    pieces: list[str | Media] = []
    for b in m.content:
        if isinstance(b, ToolResultBlock):
            if b.tool_use_id not in calls:
                raise InvalidSettingsError(
                    f"messages.{i}: tool_result answers tool_use_id {b.tool_use_id!r}, which is no tool_use block "
                    f"of the assistant turn before it (its calls: {sorted(calls)}).",
                    param=f"messages.{i}.content",
                )
            out.append(
                {
                    "role": "tool",
                    "content": _result_text(b),
                    "tool_call_id": b.tool_use_id,
                    "name": calls[b.tool_use_id],
                }
            )
        elif isinstance(b, TextBlock):
            pieces.append(b.text)
        elif isinstance(b, ImageBlock):
            pieces.append(_media(b.source, limits))
        else:
            raise InvalidSettingsError(
                f"messages.{i}: a user turn takes text, image and tool_result blocks, not {b.type}.",
                param=f"messages.{i}.content",
            )
    if pieces:
        out.append({"role": "user", "content": content_of(pieces, media)})
    return out


# --------------------------------------------------------------------------- the reply


def tool_use_id(call_id: str) -> str:
    """A call's id as Anthropic's clients expect it (``toolu_...``); it comes back in the tool_result as is."""
    return "toolu_" + call_id.removeprefix("call_")


def stop_of(
    outcome: ChatOutcome, calls: Sequence[ParsedToolCall], stops: Sequence[str]
) -> tuple[StopReason, str | None]:
    """``(stop_reason, stop_sequence)`` of a finished reply."""
    if outcome.native_finish_reason == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    hit = outcome.metadata.get("stop_string")
    if hit is not None and hit in stops:
        return "stop_sequence", hit
    return "end_turn", None


def usage_out(usage: Usage) -> UsageOut:
    """Usage in Anthropic's shape (input tokens computed and read from the cache apart)."""
    return UsageOut(
        input_tokens=usage.prompt_tokens - usage.cached_tokens,
        output_tokens=usage.completion_tokens,
        cache_read_input_tokens=usage.cached_tokens,
    )


def message_of(outcome: ChatOutcome, mid: str, model: str, body: MessagesRequest) -> MessageOut:
    """The whole reply as Anthropic's message: thinking, text, tool_use blocks."""
    calls = outcome.valid_tool_calls
    content: list[ContentOut] = []
    if outcome.reasoning:
        content.append(ThinkingOut(thinking=outcome.reasoning))
    text = outcome.content + outcome.invalid_text
    if text:
        content.append(TextOut(text=text))
    content += [ToolUseOut(id=tool_use_id(c.id), name=c.name or "", input=c.arguments or {}) for c in calls]
    # a call max_tokens cut short: its input as far as it got (stop_reason max_tokens), never its markup
    content += [
        ToolUseOut(id=tool_use_id(c.id), name=c.name or "", input=partial_object(c.written or ""))
        for c in outcome.cut_tool_calls
    ]
    if not content:
        content.append(TextOut(text=""))
    reason, sequence = stop_of(outcome, calls, body.stop_sequences or ())
    return MessageOut(
        id=mid, model=model, content=content, stop_reason=reason, stop_sequence=sequence, usage=usage_out(outcome.usage)
    )


__all__ = ["count_request", "message_of", "stop_of", "to_chat", "tool_use_id", "usage_out"]
