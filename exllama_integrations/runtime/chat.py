"""Chat requests, shared by the LangChain and LlamaIndex adapters.

Template rendering with tools, forced tool calls and JSON-schema replies (as grammar constraints),
and parsing tool calls back.

Messages arrive as template dicts (``{"role", "content", "tool_calls", ...}``, Hugging Face conventions);
each adapter converts its own message types to those.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import InvalidSettingsError
from .constraints import TokenConstraint, strict_schema, tool_call_grammar

if TYPE_CHECKING:
    from .runtime import ExLlamaRuntime
    from .settings import GenerationSettings

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(re.escape(TOOL_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(TOOL_CLOSE) + r"|$)", re.S)

FALLBACK_TOOL_PROMPT = (
    "You can call these tools. To call one, reply with only\n"
    f'{TOOL_OPEN}{{"name": <tool name>, "arguments": <arguments as a JSON object>}}{TOOL_CLOSE}\n'
    "Tools:\n{tools}"
)


@dataclass(frozen=True)
class ParsedToolCall:
    """A tool call found in model output; ``error`` is set when it could not be parsed."""

    id: str
    name: str | None
    arguments: dict[str, Any] | None
    raw: str
    error: str | None = None


@dataclass
class ChatRequest:
    """What to generate for one chat call."""

    prompt: str
    constraint: TokenConstraint | None = None
    tools_active: bool = False
    tools: list[dict[str, Any]] = field(default_factory=list)

    def settings_for(self, settings: GenerationSettings) -> GenerationSettings:
        """``settings`` for this request: with a constraint the grammar decides where output ends, not stops."""
        if self.constraint is not None and settings.stop:
            return settings.model_copy(update={"stop": []})
        return settings


def renders_tools(runtime: ExLlamaRuntime) -> bool:
    """Whether the model's chat template renders ``tools`` itself (else our documented fallback is used)."""
    return "tools" in (runtime.tokenizer.chat_template or "")


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """A tool call written the way the fallback format asks the model to write it."""
    return f"{TOOL_OPEN}{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}{TOOL_CLOSE}"


def tool_response_text(content: str) -> str:
    """A tool result as the fallback format shows it to the model (in a user turn)."""
    return f"<tool_response>\n{content}\n</tool_response>"


def add_tool_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Describe the tools in the system turn (for templates that do not render ``tools``)."""
    specs = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    note = FALLBACK_TOOL_PROMPT.replace("{tools}", specs)
    return add_system_note(messages, note)


def add_system_note(messages: list[dict[str, Any]], note: str) -> list[dict[str, Any]]:
    """Append ``note`` to the system turn, adding one if there is none."""
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": (messages[0]["content"] or "") + "\n\n" + note}] + messages[1:]
    return [{"role": "system", "content": note}] + messages


def forced_tools(tools: list[dict[str, Any]], tool_choice: Any) -> list[dict[str, Any]] | None:
    """The tools a tool_choice forces a call to (None: the model decides; []: no tools)."""
    if tool_choice in (None, "auto"):
        return None
    if tool_choice in ("none", False):
        return []
    if tool_choice in ("any", "required", True):
        return tools
    name = tool_choice
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
    chosen = [t for t in tools if t["function"]["name"] == name]
    if not chosen:
        raise InvalidSettingsError(
            f"tool_choice {tool_choice!r} names no bound tool; bound: {[t['function']['name'] for t in tools]}."
        )
    return chosen


def parse_tool_calls(text: str) -> tuple[str, list[ParsedToolCall]]:
    """Split model output into its text and the ``<tool_call>`` blocks in it; every call gets an id."""
    calls = []
    for raw in _CALL_RE.findall(text):
        cid = f"call_{uuid.uuid4().hex[:24]}"
        try:
            obj = json.loads(raw)
            name = obj["name"]
            args = obj.get("arguments", obj.get("parameters", {}))
            if isinstance(args, str):
                args = json.loads(args) if args.strip() else {}
            if not isinstance(name, str) or not isinstance(args, dict):
                raise TypeError("name must be a string and arguments an object")
            calls.append(ParsedToolCall(cid, name, args, raw))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            m = re.search(r'"name"\s*:\s*"([^"]+)"', raw)
            calls.append(ParsedToolCall(cid, m.group(1) if m else None, None, raw, f"{type(e).__name__}: {e}"))
    content = _CALL_RE.sub("", text).strip() if calls else text
    return content, calls


def schema_instructions(schema: dict[str, Any] | None) -> str:
    """What the model is told about the JSON it must write (the grammar enforces it; words make it likely)."""
    if schema is None:
        return "Reply with a JSON object."
    return "Reply with a JSON object that follows this JSON schema:\n" + json.dumps(schema, ensure_ascii=False)


def build_chat_request(
    runtime: ExLlamaRuntime,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    tool_choice: Any = None,
    json_schema: dict[str, Any] | None = None,
    json_object: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> ChatRequest:
    """Render a chat call and build its constraint.

    Tools go to the template when it renders them, else into the system turn. A forced tool_choice
    becomes a grammar for exactly one well-formed call; ``json_schema`` / ``json_object`` become a
    JSON grammar (strict: no keys beyond the schema's), and the schema is stated in the system turn.
    """
    tools = tools or []
    forced = forced_tools(tools, tool_choice) if tools else None
    shown = tools if tools and forced != [] else []
    native = renders_tools(runtime)
    constraint = None
    if forced:
        constraint = TokenConstraint.lark(runtime.tokenizer, tool_call_grammar(forced, TOOL_OPEN, TOOL_CLOSE))
    elif json_schema is not None or json_object:
        schema = strict_schema(json_schema) if json_schema is not None else {"type": "object"}
        constraint = TokenConstraint.json_schema(runtime.tokenizer, schema)
        messages = add_system_note(messages, schema_instructions(json_schema))
    if shown and not native:
        messages = add_tool_prompt(messages, shown)
    prompt = runtime.chat_prompt(messages, tools=shown if (shown and native) else None, **(template_kwargs or {}))
    return ChatRequest(prompt, constraint, tools_active=bool(shown), tools=shown)
