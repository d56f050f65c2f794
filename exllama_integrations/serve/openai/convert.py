"""Chat completions and the one chat: a request to the chat request, a finished reply to OpenAI's message.

:func:`to_chat` (a :class:`~..conversion.ToChat`): messages become template messages in Hugging Face conventions
(``developer`` a system turn, ``function`` a tool turn, a user turn's ``image_url`` parts read as images are
everywhere, the legacy ``function_call`` a tool call), ``tools`` (or the legacy ``functions``), ``tool_choice``
(or the legacy ``function_call``), ``response_format`` and ``reasoning_effort`` the chat's. :func:`message_of`:
a finished reply as the assistant message (calls that read, and one cut short by ``max_tokens``, as tool calls; a
call that did not read stays text).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...chat.content import content_of
from ...chat.outcome import ChatOutcome, ParsedToolCall
from ...chat.prepare import ChatRequest
from ...contract.api import Media
from ...errors import MediaError
from ...model.media import MediaLimits, media_from_url
from ..conversion import ChatContext
from .protocol.chat import (
    AssistantMessage,
    ChatCompletionRequest,
    FunctionName,
    ImageURL,
    MessageWire,
    ToolCallOut,
    ToolCallWire,
)
from .protocol.common import refuse


def to_chat(body: ChatCompletionRequest, context: ChatContext) -> ChatRequest:
    """The chat call as the plain-data chat request every front door uses (images read within ``context.media``).

    ``context.thinking_switch``: the template reads ``enable_thinking`` (``reasoning_effort`` sets it).

    Raises:
        InvalidSettingsError: audio asked for, or ``tools`` and the legacy ``functions`` both sent.
    """
    if body.modalities is not None and "audio" in body.modalities:
        raise refuse("modalities", 'only text is served; send modalities ["text"] or leave it out.')
    if body.functions is not None and body.tools is not None:
        raise refuse("functions", "send tools or the legacy functions, not both.")
    if body.function_call is not None and body.tool_choice is not None:
        raise refuse("function_call", "send tool_choice or the legacy function_call, not both.")
    if body.tools is not None:
        tools = [t.model_dump(exclude_none=True) for t in body.tools]
    else:
        tools = [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in body.functions or []]
    choice: Any = body.tool_choice
    if isinstance(body.function_call, FunctionName):
        choice = {"type": "function", "function": {"name": body.function_call.name}}
    elif body.function_call is not None:
        choice = body.function_call
    media: list[Media] = []
    messages = [template_message(m, media, context.media) for m in body.messages]
    template_kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        template_kwargs.setdefault("reasoning_effort", body.reasoning_effort)
        if context.thinking_switch:
            template_kwargs.setdefault("enable_thinking", body.reasoning_effort != "none")
    return ChatRequest(
        messages=messages,
        settings=body.to_settings(context.defaults, context.refused, context.max_tokens),
        tools=tools,
        tool_choice=choice if tools else None,
        response_format=body.response_format,
        template_kwargs=template_kwargs,
        chat_template=context.chat_template,
        split_special_tokens=body.split_special_tokens,
        media=media,
        parallel_tool_calls=body.parallel_tool_calls,
    )


def template_message(
    message: MessageWire, media: list[Media] | None = None, limits: MediaLimits | None = None
) -> dict[str, Any]:
    """The message as a template dict (Hugging Face conventions); a user turn's images go to ``media``."""
    role = "system" if message.role == "developer" else "tool" if message.role == "function" else message.role
    content = _content(message, media if role == "user" else None, limits or MediaLimits())
    d: dict[str, Any] = {"role": role, "content": content}
    if message.name:
        d["name"] = message.name
    if message.tool_calls:
        d["tool_calls"] = [c.model_dump() for c in message.tool_calls]
    elif message.function_call is not None:  # the legacy form of one tool call
        d["tool_calls"] = [ToolCallWire(function=message.function_call).model_dump()]
    if message.tool_call_id:
        d["tool_call_id"] = message.tool_call_id
    thought = message.reasoning_content or message.reasoning
    if thought and role == "assistant":
        d["reasoning_content"] = thought
    return d


def _content(message: MessageWire, media: list[Media] | None, limits: MediaLimits) -> str | list[dict[str, Any]]:
    """The message's content: its text, or text and image parts, the images appended to ``media``.

    With ``media=None`` (a turn that is not the user's) images are refused.
    """
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    pieces: list[str | Media] = []
    for part in message.content:
        if part.type == "text":
            pieces.append(part.text or "")
        elif part.type == "refusal" and message.role == "assistant":
            pieces.append(part.refusal or "")
        elif part.type == "image_url" and media is not None and part.image_url is not None:
            ref = part.image_url
            pieces.append(media_from_url(ref.url if isinstance(ref, ImageURL) else ref, limits))
        else:
            raise MediaError(
                f"message content of type {part.type!r} is not taken here: send text parts "
                "(and image_url parts in user turns).",
                param="messages",
            )
    return content_of(pieces, media if media is not None else [])


def tool_calls_out(
    calls: Sequence[ParsedToolCall], with_index: bool = False, first: int = 0
) -> list[ToolCallOut] | None:
    """The calls that read whole, and one ``max_tokens`` cut short, as OpenAI tool calls.

    The cut one carries its arguments as far as they got. ``first``: the index of the first among the reply's.
    """
    shown = [c for c in calls if c.error is None or (c.cut and c.name)]
    if not shown:
        return None
    return [
        ToolCallOut(
            id=c.id,
            function={"name": c.name or "", "arguments": c.arguments_text if not c.cut else c.written or ""},
            index=i if with_index else None,
        )
        for i, c in enumerate(shown, first)
    ]


def message_of(outcome: ChatOutcome) -> AssistantMessage:
    """The assistant message of a finished chat: a call that did not read is not a call, its raw text stays text.

    A call cut short by ``max_tokens`` is a call with its arguments as far as they got (``finish_reason: "length"``,
    as OpenAI's API answers it); its markup never reaches the text.
    """
    calls = tool_calls_out(outcome.tool_calls)
    thought = outcome.reasoning or None
    text = outcome.content + outcome.invalid_text
    content: str | None = text if not calls else (text or None)
    return AssistantMessage(content=content, reasoning_content=thought, reasoning=thought, tool_calls=calls)


__all__ = ["message_of", "template_message", "to_chat", "tool_calls_out"]
