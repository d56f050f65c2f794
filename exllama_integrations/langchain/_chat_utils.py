"""LangChain messages as chat-template dicts, and chat outcomes back as LangChain chunks (types only)."""

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

from ..errors import InvalidSettingsError
from ..runtime.chat import TOOL_OPEN
from ..runtime.chat_outcome import ChatDelta, ChatOutcome, logprobs_content


def text_of(content: str | list[Any]) -> str:
    """The text of a message's content (text blocks joined; other blocks refused with a clear error)."""
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict):
            kind = block.get("type")
            if kind == "text":
                parts.append(str(block.get("text", "")))
            elif kind in ("tool_use", "tool_call", "function_call", "reasoning", "thinking"):
                continue  # carried by tool_calls / not shown to the model again
            else:
                raise InvalidSettingsError(
                    f"message content of type {kind!r} is not supported: this model takes text only."
                )
    return "".join(parts)


def to_template_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages as ``{"role", "content", ...}`` dicts in Hugging Face conventions (see runtime.chat)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if isinstance(m, SystemMessage):
            d: dict[str, Any] = {"role": "system", "content": text_of(m.content)}
        elif isinstance(m, HumanMessage):
            d = {"role": "user", "content": text_of(m.content)}
        elif isinstance(m, AIMessage):
            d = {"role": "assistant", "content": text_of(m.content)}
            if m.tool_calls:
                d["tool_calls"] = [
                    {"id": c.get("id"), "type": "function", "function": {"name": c["name"], "arguments": c["args"]}}
                    for c in m.tool_calls
                ]
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


def lc_chat_chunk(item: ChatDelta | ChatOutcome, wants_logprobs: bool) -> ChatGenerationChunk:
    """A chat delta or the final outcome as a LangChain chunk (the outcome carries usage and tool calls)."""
    if isinstance(item, ChatDelta):
        lp: dict[str, Any] = {"logprobs": {"content": logprobs_content(item.logprobs)}} if item.logprobs else {}
        return ChatGenerationChunk(message=AIMessageChunk(content=item.text, response_metadata=lp))
    tool_chunks = []
    for i, c in enumerate(item.tool_calls):
        # A malformed call keeps its raw text, tag included: LangChain's partial-JSON parse of chunk args
        # would otherwise "repair" it into a valid-looking call with missing arguments.
        args = TOOL_OPEN + c.raw if c.error else json.dumps(c.arguments, ensure_ascii=False)
        tool_chunks.append({"name": c.name, "args": args, "id": c.id, "index": i, "type": "tool_call_chunk"})
    md: dict[str, Any] = {**item.metadata, "model_provider": "exllama"}
    if wants_logprobs:
        md["logprobs"] = {"content": []}  # the streamed chunks' logprobs concatenate into this
    usage = UsageMetadata(  # type: ignore[typeddict-item]  # the token details are optional
        input_tokens=item.usage.prompt_tokens,
        output_tokens=item.usage.completion_tokens,
        total_tokens=item.usage.total_tokens,
    )
    msg = AIMessageChunk(
        content=item.tail,
        usage_metadata=usage,
        response_metadata=md,
        tool_call_chunks=tool_chunks,  # type: ignore[arg-type]  # dicts of ToolCallChunk's shape
        chunk_position="last",
    )
    return ChatGenerationChunk(message=msg, generation_info={"finish_reason": item.finish_reason})


__all__ = ["lc_chat_chunk", "text_of", "to_template_messages"]
