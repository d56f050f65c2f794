"""LlamaIndex types to and from the chat contract's plain values (messages, logprobs, streamed responses).

Reasoning travels LlamaIndex's way: an earlier turn's ``ThinkingBlock`` goes to the template as
``reasoning_content`` (it keeps or strips it); a reply's thinking is a ``ThinkingBlock`` in ``message.blocks``
and ``thinking_delta`` in the streamed responses' ``additional_kwargs``, never in ``content``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, LogProb, MessageRole

from ..chat.content import content_of
from ..contract.api import Media, TokenLogprob
from ..errors import InvalidSettingsError, MediaError
from ..model.media import in_process_limits, media_from_bytes, media_from_path, media_from_url


def message_text(message: ChatMessage) -> str:
    """The text of a message's blocks (tool calls and thinking are carried apart; media refused)."""
    content = message_content(message, None)
    assert isinstance(content, str)
    return content


def _image(block: Any) -> Media:
    limits = in_process_limits()
    mime = getattr(block, "image_mimetype", None)
    if getattr(block, "image", None) is not None:
        try:
            data = block.resolve_image(as_base64=False).read(limits.max_bytes + 1)
        except ValueError as e:
            raise MediaError(f"an ImageBlock's image could not be read: {e}") from None
        return media_from_bytes(data, mime, limits)
    if getattr(block, "path", None) is not None:
        return media_from_path(block.path, mime, limits)
    if getattr(block, "url", None) is not None:
        return media_from_url(str(block.url), limits, mime)
    raise MediaError("an ImageBlock has no image, path or url.")


def message_content(message: ChatMessage, media: list[Media] | None) -> str | list[dict[str, Any]]:
    """A message's content: its text, or text and image parts with the images appended to ``media``.

    With ``media=None`` images are refused (a place that takes text only).
    """
    pieces: list[str | Media] = []
    for block in message.blocks:
        kind = getattr(block, "block_type", "text")
        if kind == "text":
            pieces.append(block.text)  # type: ignore[union-attr]
        elif kind == "image" and media is not None:
            pieces.append(_image(block))
        elif kind in ("image", "audio", "video", "document"):
            raise MediaError(f"message blocks of type {kind!r} are not taken here: send text (and images to a chat).")
        elif kind not in ("tool_call", "thinking"):
            raise InvalidSettingsError(f"message blocks of type {kind!r} are not supported.")
    return content_of(pieces, media if media is not None else [])


def message_thinking(message: ChatMessage) -> str | None:
    """An assistant turn's thinking (its ``ThinkingBlock`` content), or None."""
    parts = [getattr(b, "content", None) for b in message.blocks if getattr(b, "block_type", "") == "thinking"]
    return "".join(p for p in parts if isinstance(p, str)) if parts else None


def template_messages(messages: Sequence[ChatMessage], media: list[Media] | None = None) -> list[dict[str, Any]]:
    """LlamaIndex messages as template dicts in Hugging Face conventions (see chat.prepare).

    A user turn's ``ImageBlock`` becomes an image part, its bytes appended to ``media`` (None: images refused).
    """
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.role.value if isinstance(m.role, MessageRole) else str(m.role)
        d: dict[str, Any] = {
            "role": "system" if role == MessageRole.DEVELOPER.value else role,
            "content": message_content(m, media if role == MessageRole.USER.value else None),
        }
        calls = m.additional_kwargs.get("tool_calls") or []
        if role == MessageRole.ASSISTANT.value and calls:
            d["tool_calls"] = [{"id": c.get("id"), "type": "function", "function": dict(c["function"])} for c in calls]
        thought = message_thinking(m) if role == MessageRole.ASSISTANT.value else None
        if thought:
            d["reasoning_content"] = thought
        if role in (MessageRole.TOOL.value, MessageRole.FUNCTION.value):
            d = {"role": "tool", "content": d["content"], "tool_call_id": m.additional_kwargs.get("tool_call_id")}
        out.append(d)
    return out


def li_logprobs(lps: Sequence[TokenLogprob] | None) -> list[list[LogProb]] | None:
    """LlamaIndex's shape: per token, the most likely alternatives (the chosen token when none were asked for)."""
    if not lps:
        return None
    return [
        [LogProb(token=t.token, logprob=t.logprob, bytes=list(t.token.encode())) for t in lp.top]
        or [LogProb(token=lp.token, logprob=lp.logprob, bytes=list(lp.token.encode()))]
        for lp in lps
    ]


def _with_logprobs(last: Any, lps: list[Any], all_logprobs: bool) -> Any:
    assert last is not None
    if all_logprobs or lps:
        last.logprobs = lps or None
    return last


def last_response(responses: Any, all_logprobs: bool = False) -> Any:
    """The last of a stream of responses; with ``all_logprobs``, carrying every token's logprobs."""
    last, lps = None, []  # type: ignore[var-annotated]
    for last in responses:  # noqa: B007 - keep the last
        lps.extend(last.logprobs or [])
    return _with_logprobs(last, lps, all_logprobs)


async def alast_response(responses: Any, all_logprobs: bool = False) -> Any:
    """Async :func:`last_response`."""
    last, lps = None, []  # type: ignore[var-annotated]
    async for last in responses:  # noqa: B007 - keep the last
        lps.extend(last.logprobs or [])
    return _with_logprobs(last, lps, all_logprobs)


def is_custom_messages_to_prompt(fn: Any) -> bool:
    """Whether ``messages_to_prompt`` is the caller's own (then their prompt is used instead of the template)."""
    from llama_index.core.base.llms.generic_utils import messages_to_prompt as default

    return fn is not None and fn is not default and getattr(fn, "__name__", "") != "messages_to_prompt"
