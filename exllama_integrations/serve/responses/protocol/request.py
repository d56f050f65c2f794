"""The Responses API's request as a wire model (its items and options in :mod:`.items` and :mod:`.options`).

``input`` is text or items: messages (``input_text``, ``input_image``, ``output_text`` and ``refusal`` parts),
``function_call`` and ``function_call_output`` items, and ``reasoning`` items given back (an earlier turn's
thinking, which the template keeps or strips). ``instructions`` is the system turn; function tools come flat
(``{"type": "function", "name", "parameters", "strict"}``); ``text.format`` asks for JSON (``json_schema``,
``json_object``); ``reasoning.effort`` turns thinking off (``none``, ``minimal``) or on where the template has the
switch (``enable_thinking``); ``max_output_tokens`` bounds thinking and answer together; ``include:
["message.output_text.logprobs"]`` with ``top_logprobs`` asks for the answer's log-probabilities. Fields OpenAI
documents that change nothing here (``metadata``, ``user``, ``store``, other ``include`` entries ...) are accepted and
ignored; those that need state this server does not keep (``previous_response_id``, ``conversation``,
``background``, ``prompt``, ``item_reference`` items) are refused naming the field; any other field is a typo.
The input items' wire models are in :mod:`.items`, the options' (tools, text format, reasoning) in :mod:`.options`;
what each field means for the chat is :mod:`..convert`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import Field

from .items import (
    InputItem,
    MessageItem,
    Strict,
    item_tags,
)
from .options import FunctionChoice, FunctionTool, ReasoningConfig, ResponsesStreamOptions, TextConfig

LOGPROBS = "message.output_text.logprobs"
"""The ``include`` entry that asks for the answer's log-probabilities (``top_logprobs``: alternatives a token)."""


class ResponsesRequest(Strict):
    """``POST /v1/responses``."""

    model: str | None = None
    """The served model (default: the one this server serves)."""
    input: str | list[InputItem]
    """The conversation: a user message's text, or items (messages, calls, their outputs, reasoning)."""
    instructions: str | None = None
    """The system turn, before ``input``."""
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    """False: at most one call in the reply."""
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    """Most tokens of the reply, thinking included; a reply cut there is ``status: "incomplete"``."""
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    # OpenAI fields that change nothing here
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    truncation: Literal["disabled", "auto"] | None = None
    """``auto``: the oldest input items are dropped where the conversation is over the context (:mod:`..truncation`)."""
    max_tool_calls: int | None = Field(default=None, ge=1)
    # OpenAI fields that need state this server does not keep: refused when set
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    prompt: dict[str, Any] | None = None

    def has_images(self) -> bool:
        """Whether any message has image parts (reading them may fetch, so it runs off the event loop)."""
        if isinstance(self.input, str):
            return False
        return any(
            isinstance(i, MessageItem)
            and isinstance(i.content, list)
            and any(p.type == "input_image" for p in i.content)
            for i in self.input
        )

    @property
    def wants_logprobs(self) -> bool:
        """Whether ``include`` asks for the answer's log-probabilities (``message.output_text.logprobs``)."""
        return LOGPROBS in (self.include or ())


ALL_FIELDS = sorted(ResponsesRequest.model_fields)
"""The request's field names (for "did you mean" on a misspelt one)."""


def _where(loc: Sequence[Any]) -> tuple[Any, ...]:
    """A field's path as the client wrote it (pydantic's union branches, ``str`` or ``tagged-union[...]``, left out)."""
    return tuple(p for p in loc if not (isinstance(p, str) and (p in _BRANCHES or "[" in p)))


_BRANCHES = frozenset({"str", "int", "float", "bool", "dict", "list", "function-after", *item_tags()})


def plain_errors(errors: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Schema errors as a client reads them: pydantic's branch names and the other shapes' complaints left out.

    Where a field takes several shapes (``input``: text or items), the wrong-type complaints of the shapes it
    did not take are dropped when a closer complaint exists.
    """
    close = [e for e in errors if not str(e.get("type", "")).endswith("_type")] or list(errors)
    return [{**e, "loc": _where(e.get("loc", ()))} for e in close]
