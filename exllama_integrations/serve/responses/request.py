"""The Responses API's request as a wire model, and the chat call it stands for (:meth:`ResponsesRequest.to_chat`).

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
The input items' wire models are in :mod:`.items`, the options' (tools, text format, reasoning) in :mod:`.options`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import Field

from ...chat.content import content_of
from ...chat.prepare import ChatRequest
from ...contract.api import Media
from ...contract.settings import GenerationSettings, resolve_settings
from ...errors import InvalidSettingsError, MediaError
from ...model.media import MediaLimits, media_from_url
from .items import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputImage,
    InputItem,
    InputText,
    ItemReference,
    MessageItem,
    OutputText,
    ReasoningItem,
    RefusalPart,
    Strict,
    item_tags,
)
from .options import FunctionChoice, FunctionTool, ReasoningConfig, ResponsesStreamOptions, TextConfig


LOGPROBS = "message.output_text.logprobs"
"""The ``include`` entry that asks for the answer's log-probabilities (``top_logprobs``: alternatives a token)."""


def _refuse(field: str, why: str) -> InvalidSettingsError:
    return InvalidSettingsError(f"{field}: {why}", param=field, reason="unsupported_parameter")


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
    """``auto``: the oldest input items are dropped where the conversation is over the context (:mod:`.truncation`)."""
    max_tool_calls: int | None = Field(default=None, ge=1)
    # OpenAI fields that need state this server does not keep: refused when set
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    prompt: dict[str, Any] | None = None

    def check_stateless(self) -> None:
        """Refuse what needs a stored response, conversation or prompt (this server keeps none).

        Raises:
            InvalidSettingsError: naming the field.
        """
        again = "send the whole conversation as input items (an earlier response's output items included)."
        if self.previous_response_id is not None:
            raise _refuse("previous_response_id", f"this server keeps no responses (as with store: false); {again}")
        if self.conversation is not None:
            raise _refuse("conversation", f"this server keeps no conversations; {again}")
        if self.background:
            raise _refuse("background", "this server answers in the foreground only; send background: false.")
        if self.prompt is not None:
            raise _refuse("prompt", "this server keeps no prompt templates; send the text as input and instructions.")
        if not isinstance(self.input, str) and any(isinstance(i, ItemReference) for i in self.input):
            raise _refuse("input", f"item_reference items need stored items, and this server keeps none; {again}")

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

    def to_settings(
        self, defaults: GenerationSettings, refused: Mapping[str, str], max_tokens_cap: int | None
    ) -> GenerationSettings:
        """The request's settings over the server's defaults, resolved once.

        ``max_tokens_cap`` (``serve --max-tokens``) caps ``max_output_tokens``: more is refused; none gets the cap.
        """
        asked = self.max_output_tokens
        if asked is not None and max_tokens_cap is not None and asked > max_tokens_cap:
            raise InvalidSettingsError(
                f"max_output_tokens is {asked}; this server allows at most {max_tokens_cap}.",
                param="max_output_tokens",
                reason="max_tokens_too_large",
            )
        base = defaults
        fills = defaults.max_new_tokens is None  # the server's default fills the context: the cap bounds it too
        if asked is None and max_tokens_cap is not None and (fills or (defaults.max_new_tokens or 0) > max_tokens_cap):
            base = defaults.model_copy(update={"max_new_tokens": max_tokens_cap})
        values = {"temperature": self.temperature, "top_p": self.top_p, "max_new_tokens": asked}
        if self.wants_logprobs:  # the answer's tokens with their log-probabilities (and top_logprobs alternatives)
            values["logprobs"] = self.top_logprobs or 0
        return resolve_settings(base, refused, **{k: v for k, v in values.items() if v is not None})

    @property
    def wants_logprobs(self) -> bool:
        """Whether ``include`` asks for the answer's log-probabilities (``message.output_text.logprobs``)."""
        return LOGPROBS in (self.include or ())

    def messages(self, media: list[Media], limits: MediaLimits) -> list[dict[str, Any]]:
        """The conversation as template messages (Hugging Face conventions); user images appended to ``media``."""
        out: list[dict[str, Any]] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        thought = ""  # a reasoning item goes with the assistant turn right after it
        for item in items:
            if isinstance(item, ReasoningItem):
                thought += item.thought()
                continue
            if isinstance(item, FunctionCallItem):
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                if out and out[-1]["role"] == "assistant" and not thought:
                    out[-1].setdefault("tool_calls", []).append(call)  # calls of the assistant turn just before
                    continue
                d: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [call]}
            elif isinstance(item, FunctionCallOutputItem):
                d = {"role": "tool", "content": _content(item.output, None, limits), "tool_call_id": item.call_id}
            elif isinstance(item, MessageItem):
                role = "system" if item.role == "developer" else item.role
                d = {"role": role, "content": _content(item.content, media if role == "user" else None, limits)}
            else:
                continue  # an item_reference: refused by check_stateless
            if d["role"] == "assistant" and thought:
                d["reasoning_content"] = thought
            thought = ""
            out.append(d)
        return out

    def to_chat(
        self,
        defaults: GenerationSettings,
        refused: Mapping[str, str],
        max_tokens_cap: int | None = None,
        chat_template: str | None = None,
        media_limits: MediaLimits | None = None,
    ) -> ChatRequest:
        """The chat call as the plain-data chat request every front door uses (images read within ``media_limits``).

        Raises:
            InvalidSettingsError: a field that needs server-side state, or bad settings.
            MediaError: an image that cannot be read, or a part this server does not take.
        """
        self.check_stateless()
        tools = [t.to_chat_tool() for t in self.tools or []]
        choice: Any = self.tool_choice
        if isinstance(choice, FunctionChoice):
            choice = {"type": "function", "function": {"name": choice.name}}
        media: list[Media] = []
        messages = self.messages(media, media_limits or MediaLimits())
        return ChatRequest(
            messages=messages,
            settings=self.to_settings(defaults, refused, max_tokens_cap),
            tools=tools,
            tool_choice=choice if tools else None,
            response_format=self.text.response_format() if self.text is not None else None,
            template_kwargs=self.reasoning.template_kwargs() if self.reasoning is not None else {},
            chat_template=chat_template,
            media=media,
            parallel_tool_calls=self.parallel_tool_calls,
            max_tool_calls=self.max_tool_calls,
        )


def _content(content: str | list[Any], media: list[Media] | None, limits: MediaLimits) -> str | list[dict[str, Any]]:
    """A message's content for the template: text, or text and image parts (``media=None``: images refused)."""
    if isinstance(content, str):
        return content
    pieces: list[str | Media] = []
    for part in content:
        if isinstance(part, (InputText, OutputText)):
            pieces.append(part.text)
        elif isinstance(part, RefusalPart):
            pieces.append(part.refusal)
        elif isinstance(part, InputImage) and media is not None:
            if part.image_url is None:
                raise MediaError(
                    "input_image: this server keeps no files (file_id); send image_url as a data: URL.", param="input"
                )
            pieces.append(media_from_url(part.image_url, limits))
        else:
            raise MediaError(
                f"input parts of type {part.type!r} are not taken here: send input_text "
                "(and input_image in user messages).",
                param="input",
            )
    return content_of(pieces, media if media is not None else [])


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
