"""LangChain messages as chat-template dicts, and chat outcomes back as LangChain chunks (types only).

Reasoning travels LangChain's way: an earlier turn's thinking (``additional_kwargs["reasoning_content"]`` or a
``reasoning`` content block) goes to the template as ``reasoning_content``, which keeps or strips it; a reply's
thinking comes back in ``additional_kwargs["reasoning_content"]`` (streamed as deltas, so chunks add up), which
``content_blocks`` shows as a ``reasoning`` block, and never in ``content``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGenerationChunk
from langchain_core.utils.json import parse_partial_json

from ..chat.content import content_of
from ..chat.outcome import ArgumentsDelta, ChatDelta, ChatOutcome, ParsedToolCall
from ..contract.api import Media, Usage
from ..contract.shapes import logprobs_content
from ..errors import InvalidSettingsError, MediaError
from ..model.media import in_process_limits, media_from_base64, media_from_url

_SKIPPED = ("tool_use", "tool_call", "function_call", "reasoning", "thinking")


def text_of(content: str | list[Any]) -> str:
    """The text of a message's content (text blocks joined; other blocks refused with a clear error)."""
    out = content_of_blocks(content, None)
    assert isinstance(out, str)
    return out


def _image(block: dict[str, Any]) -> Media:
    """An image content block of any of LangChain's shapes, as bytes."""
    limits = in_process_limits()
    mime = block.get("mime_type")
    if block.get("type") == "image_url":  # OpenAI's shape
        ref = block.get("image_url")
        url = ref.get("url") if isinstance(ref, dict) else ref
        if not isinstance(url, str):
            raise MediaError("an image_url block needs image_url={'url': 'data:image/...' or 'https://...'}.")
        return media_from_url(url, limits)
    source = block.get("source_type")  # LangChain v0: source_type "base64" | "url", the payload in "data" / "url"
    data = block.get("base64") or (block.get("data") if source == "base64" else None)
    if isinstance(data, str):
        return media_from_base64(data, mime, limits)
    url = block.get("url") or (block.get("data") if source == "url" else None)
    if isinstance(url, str):
        return media_from_url(url, limits, mime)
    if block.get("file_id") or source == "id":
        raise MediaError("an image given by file id cannot be read here; send its bytes (base64) or a URL.")
    raise MediaError("an image block needs 'base64' data (with 'mime_type') or a 'url'.")


def content_of_blocks(content: str | list[Any], media: list[Media] | None) -> str | list[dict[str, Any]]:
    """A message's content: its text, or text and image parts with the images appended to ``media``.

    With ``media=None`` images are refused (a place that takes text only).
    """
    if isinstance(content, str):
        return content
    pieces: list[str | Media] = []
    for block in content:
        if isinstance(block, str):
            pieces.append(block)
        elif isinstance(block, dict):
            kind = block.get("type")
            if kind == "text":
                pieces.append(str(block.get("text", "")))
            elif kind in _SKIPPED:
                continue  # carried by tool_calls / reasoning_content
            elif kind in ("image", "image_url") and media is not None:
                pieces.append(_image(block))
            elif kind in ("image", "image_url", "file", "audio", "video"):
                raise MediaError(
                    f"message content of type {kind!r} is not taken here: send text (and images in a user turn)."
                )
            else:
                raise InvalidSettingsError(f"message content of type {kind!r} is not supported.")
    return content_of(pieces, media if media is not None else [])


def reasoning_of(message: AIMessage) -> str | None:
    """An assistant turn's thinking: ``additional_kwargs["reasoning_content"]`` or its ``reasoning`` blocks."""
    given = message.additional_kwargs.get("reasoning_content")
    if isinstance(given, str):
        return given
    if isinstance(message.content, list):
        parts = [
            str(b.get("reasoning", "")) for b in message.content if isinstance(b, dict) and b.get("type") == "reasoning"
        ]
        if parts:
            return "".join(parts)
    return None


def to_template_messages(messages: Sequence[BaseMessage], media: list[Media] | None = None) -> list[dict[str, Any]]:
    """LangChain messages as ``{"role", "content", ...}`` dicts in Hugging Face conventions (see chat.prepare).

    A user turn's image blocks become image parts, their bytes appended to ``media`` (None: images refused).
    """
    out: list[dict[str, Any]] = []
    for m in messages:
        if isinstance(m, SystemMessage):
            d: dict[str, Any] = {"role": "system", "content": text_of(m.content)}
        elif isinstance(m, HumanMessage):
            d = {"role": "user", "content": content_of_blocks(m.content, media)}
        elif isinstance(m, AIMessage):
            d = {"role": "assistant", "content": text_of(m.content)}
            if m.tool_calls:
                d["tool_calls"] = [
                    {"id": c.get("id"), "type": "function", "function": {"name": c["name"], "arguments": c["args"]}}
                    for c in m.tool_calls
                ]
            thought = reasoning_of(m)
            if thought:
                d["reasoning_content"] = thought
        elif isinstance(m, ToolMessage):
            body = text_of(m.content)
            if getattr(m, "status", "success") == "error":
                body = f"Error: {body}"
            d = {"role": "tool", "content": body, "tool_call_id": m.tool_call_id}
        elif isinstance(m, ChatMessage):
            d = {"role": m.role, "content": text_of(m.content)}
        else:
            raise InvalidSettingsError(f"unsupported message type {type(m).__name__}")
        if getattr(m, "name", None) and "name" not in d:
            d["name"] = m.name
        out.append(d)
    return out


def usage_metadata(usage: Usage) -> UsageMetadata:
    """Usage in LangChain's shape, with the reasoning and cache-read details."""
    return UsageMetadata(
        input_tokens=usage.prompt_tokens,
        output_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        input_token_details={"cache_read": usage.cached_tokens},
        output_token_details={"reasoning": usage.reasoning_tokens},
    )


def _tool_call_chunks(
    calls: Sequence[ParsedToolCall], first_index: int, arguments: Sequence[ArgumentsDelta] = ()
) -> list[dict[str, Any]]:
    """Calls as LangChain tool-call chunks; one that did not read keeps its raw text (``invalid_tool_calls``).

    A forced call's arguments come as they are written (``arguments``: a chunk each, merged by index), and the
    call is not sent again when whole. A call cut short by ``max_tokens`` keeps its name and its arguments as far
    as they got, never its markup. LangChain re-reads chunk args as partial JSON: the text of a call that did not
    read that would pass as a cut-off JSON object is quoted, so it is never "repaired" into a call with missing
    arguments.
    """
    out = [
        {
            "name": d.name if d.first else None,
            "args": d.delta,
            "id": d.id if d.first else None,
            "index": d.index,
            "type": "tool_call_chunk",
        }
        for d in arguments
    ]
    for i, c in enumerate(calls, first_index):
        if c.error is None and c.written is not None:
            continue  # streamed as it was written
        if c.cut and not c.name:
            continue  # cut before its name was whole: no call at all (as on the server)
        args = c.arguments_text
        if c.error is not None:
            kept = (c.written or "") if c.cut else c.raw
            try:
                repairable = not kept or isinstance(parse_partial_json(kept), dict)  # ("" would read as {})
            except Exception:  # noqa: BLE001 - any failure to read means it stays invalid, as wanted
                repairable = False
            args = json.dumps(kept, ensure_ascii=False) if repairable else kept
        out.append({"name": c.name, "args": args, "id": c.id, "index": i, "type": "tool_call_chunk"})
    return out


def lc_chat_chunk(item: ChatDelta | ChatOutcome, wants_logprobs: bool) -> ChatGenerationChunk:
    """A chat delta or the final outcome as a LangChain chunk (the outcome carries usage and the last calls).

    Each call's chunk index is its place in the reply, so calls streamed early and late add up.
    """
    if isinstance(item, ChatDelta):
        lp: dict[str, Any] = {"logprobs": {"content": logprobs_content(item.logprobs)}} if item.logprobs else {}
        extra = {"reasoning_content": item.reasoning} if item.reasoning else {}
        return ChatGenerationChunk(
            message=AIMessageChunk(
                content=item.text,
                response_metadata=lp,
                additional_kwargs=extra,
                tool_call_chunks=_tool_call_chunks(item.tool_calls, item.calls_before, item.arguments),  # type: ignore[arg-type]
            )
        )
    md: dict[str, Any] = {**item.metadata, "model_provider": "exllama"}
    if wants_logprobs:
        md["logprobs"] = {"content": []}  # the streamed chunks' logprobs concatenate into this
    last = item.tool_calls[item.streamed_calls :]
    msg = AIMessageChunk(
        content=item.tail,
        additional_kwargs={"reasoning_content": item.reasoning_tail} if item.reasoning_tail else {},
        usage_metadata=usage_metadata(item.usage),
        response_metadata=md,
        tool_call_chunks=_tool_call_chunks(last, item.streamed_calls, item.arguments),  # type: ignore[arg-type]
        chunk_position="last",
    )
    return ChatGenerationChunk(message=msg, generation_info={"finish_reason": item.finish_reason})


__all__ = ["lc_chat_chunk", "reasoning_of", "text_of", "to_template_messages", "usage_metadata"]
