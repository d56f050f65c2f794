"""The Responses API's request options as wire models, each with its conversion to what the chat layer takes.

Function tools and ``tool_choice``, ``text.format``, ``reasoning`` and ``stream_options``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from .items import Strict

THINKING_OFF = frozenset({"none", "minimal"})
"""``reasoning.effort`` values that turn thinking off where the template can (``enable_thinking=False``)."""


class FunctionTool(Strict):
    """A function the model may call, in the Responses API's flat shape."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def to_chat_tool(self) -> dict[str, Any]:
        """The tool as the chat layer takes it (OpenAI's chat shape)."""
        return {"type": "function", "function": self.model_dump(exclude_none=True, exclude={"type"})}


class FunctionChoice(Strict):
    """``tool_choice`` naming one function: the reply is a call to it."""

    type: Literal["function"]
    name: str


class FormatText(Strict):
    """Plain text (the default)."""

    type: Literal["text"]


class FormatJsonObject(Strict):
    """Any JSON object."""

    type: Literal["json_object"]


class FormatJsonSchema(Strict):
    """JSON that follows ``schema`` (held to it by a grammar, ``strict`` or not)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["json_schema"]
    name: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[FormatText | FormatJsonObject | FormatJsonSchema, Field(discriminator="type")]


class TextConfig(Strict):
    """``text``: the reply's format (``verbosity`` is accepted and ignored)."""

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None

    def response_format(self) -> dict[str, Any] | None:
        """The format as the chat layer takes it (OpenAI's chat ``response_format``)."""
        f = self.format
        if isinstance(f, FormatJsonSchema):
            return {"type": "json_schema", "json_schema": {"name": f.name or "response", "schema": f.schema_}}
        if isinstance(f, FormatJsonObject):
            return {"type": "json_object"}
        return None


class ReasoningConfig(Strict):
    """``reasoning``: ``effort`` turns thinking off or on (``summary`` is accepted; the thinking comes back whole)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's switches for this effort (a template without them ignores them)."""
        if self.effort is None:
            return {}
        kwargs: dict[str, Any] = {"enable_thinking": self.effort not in THINKING_OFF}
        if self.effort in ("low", "medium", "high"):
            kwargs["reasoning_effort"] = self.effort  # gpt-oss's templates read it
        return kwargs


class ResponsesStreamOptions(Strict):
    """``stream_options`` (``include_obfuscation`` is accepted; no obfuscation is added)."""

    include_obfuscation: bool | None = None
