"""LangChain messages to template dicts and tool calls back (the shared logic is in runtime.chat)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.tool import invalid_tool_call, tool_call

from ..errors import InvalidSettingsError
from ..runtime.chat import ParsedToolCall, parse_tool_calls, tool_call_text, tool_response_text


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


def to_template_messages(messages: Sequence[BaseMessage], native_tools: bool) -> list[dict[str, Any]]:
    """LangChain messages as the ``{"role", "content", ...}`` dicts that chat templates expect.

    With ``native_tools`` the template renders tool calls and results itself (HF conventions);
    otherwise calls are written as ``<tool_call>`` JSON and results as ``<tool_response>`` user turns.
    """
    out: list[dict[str, Any]] = []
    for m in messages:
        if isinstance(m, SystemMessage):
            d: dict[str, Any] = {"role": "system", "content": text_of(m.content)}
        elif isinstance(m, HumanMessage):
            d = {"role": "user", "content": text_of(m.content)}
        elif isinstance(m, AIMessage):
            text = text_of(m.content)
            if m.tool_calls and not native_tools:
                text = (text + "\n" if text else "") + "".join(
                    tool_call_text(c["name"], c["args"]) for c in m.tool_calls
                )
            d = {"role": "assistant", "content": text}
            if m.tool_calls and native_tools:
                d["tool_calls"] = [
                    {"id": c.get("id"), "type": "function", "function": {"name": c["name"], "arguments": c["args"]}}
                    for c in m.tool_calls
                ]
        elif isinstance(m, ToolMessage):
            body = text_of(m.content)
            if getattr(m, "status", "success") == "error":
                body = f"Error: {body}"
            if native_tools:
                d = {"role": "tool", "content": body, "tool_call_id": m.tool_call_id}
            else:
                d = {"role": "user", "content": tool_response_text(body)}
        elif isinstance(m, ChatMessage):
            d = {"role": m.role, "content": text_of(m.content)}
        else:
            raise InvalidSettingsError(f"unsupported message type {type(m).__name__}")
        if getattr(m, "name", None) and "name" not in d:
            d["name"] = m.name
        out.append(d)
    return out


def lc_tool_call(call: ParsedToolCall) -> Any:
    """A parsed call as a LangChain tool_call, or invalid_tool_call when it did not parse."""
    if call.error is None:
        return tool_call(name=call.name or "", args=call.arguments or {}, id=call.id)
    return invalid_tool_call(name=call.name, args=call.raw, id=call.id, error=call.error)


__all__ = ["lc_tool_call", "parse_tool_calls", "text_of", "to_template_messages"]
