"""The Responses API's request as a wire model, and the chat call it stands for (:meth:`ResponsesRequest.to_chat`).

``input`` is text or items: messages (``input_text``, ``input_image``, ``output_text`` and ``refusal`` parts),
``function_call`` and ``function_call_output`` items, and ``reasoning`` items given back (an earlier turn's
thinking, which the template keeps or strips). ``instructions`` is the system turn; function tools come flat
(``{"type": "function", "name", "parameters", "strict"}``); ``text.format`` asks for JSON (``json_schema``,
``json_object``); ``reasoning.effort`` turns thinking off (``none``, ``minimal``) or on where the template has the
switch (``enable_thinking``); ``max_output_tokens`` bounds thinking and answer together. Fields OpenAI documents
that change nothing here (``metadata``, ``user``, ``store``, ``include``, ``top_logprobs`` ...) are accepted and
ignored; those that need state this server does not keep (``previous_response_id``, ``conversation``,
``background``, ``prompt``, ``item_reference`` items) are refused naming the field; any other field is a typo.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from ...chat.content import content_of
from ...chat.prepare import ChatRequest
from ...contract.api import Media
from ...contract.settings import GenerationSettings, resolve_settings
from ...errors import InvalidSettingsError, MediaError
from ...model.media import MediaLimits, media_from_url

THINKING_OFF = frozenset({"none", "minimal"})
"""``reasoning.effort`` values that turn thinking off where the template can (``enable_thinking=False``)."""


class Strict(BaseModel):
    """A part of the request whose unknown fields are refused (a typo must not be silently dropped)."""

    model_config = ConfigDict(extra="forbid")


class Item(BaseModel):
    """An input item or part: the ids, statuses and annotations a client sends back with it are ignored."""

    model_config = ConfigDict(extra="ignore")


def _refuse(field: str, why: str) -> InvalidSettingsError:
    return InvalidSettingsError(f"{field}: {why}", param=field, reason="unsupported_parameter")


# --------------------------------------------------------------------------- input items


class InputText(Item):
    """Text a user, system or developer message holds."""

    type: Literal["input_text"]
    text: str


class OutputText(Item):
    """Text an earlier assistant message holds (its annotations and logprobs are ignored)."""

    type: Literal["output_text"]
    text: str


class RefusalPart(Item):
    """An earlier assistant refusal, kept in the history as its text."""

    type: Literal["refusal"]
    refusal: str


class InputImage(Item):
    """An image in a user message: ``image_url`` as a ``data:`` URL (http(s) only where the server allows)."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


class InputFile(Item):
    """A file part: refused (this server keeps no files and reads no documents)."""

    type: Literal["input_file"]


Part = Annotated[InputText | OutputText | RefusalPart | InputImage | InputFile, Field(discriminator="type")]


class MessageItem(Item):
    """A message: ``{"role", "content"}`` (``type: "message"`` may be left out)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]


class FunctionCallItem(Item):
    """A call the model made earlier (from an earlier response's output)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = "{}"


class FunctionCallOutputItem(Item):
    """A call's result, answering the ``function_call`` with the same ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Part]


class ReasoningPart(Item):
    """A piece of an earlier turn's thinking (``reasoning_text``) or of its summary (``summary_text``)."""

    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(Item):
    """An earlier turn's thinking, given back: it goes with the assistant turn that follows it."""

    type: Literal["reasoning"]
    summary: list[ReasoningPart] = []
    content: list[ReasoningPart] | None = None

    def thought(self) -> str:
        """The thinking's text (its summary where the text itself was not kept)."""
        return "".join(p.text for p in (self.content or self.summary))


class ItemReference(Item):
    """A reference to a stored item: refused (this server stores none)."""

    type: Literal["item_reference"]
    id: str


def _item_tags() -> tuple[str, ...]:
    return ("message", "function_call", "function_call_output", "reasoning", "item_reference")


def _item_type(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return str(kind)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[ItemReference, Tag("item_reference")],
    Discriminator(
        _item_type,
        custom_error_type="invalid_item",
        custom_error_message="an input item's type is message, function_call, function_call_output or reasoning",
    ),
]


# --------------------------------------------------------------------------- options


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


# --------------------------------------------------------------------------- the request


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
        if self.truncation == "auto":
            raise _refuse(
                "truncation",
                "this server does not drop input items to fit the context; send truncation: 'disabled' "
                "(a conversation over the context is refused with its token count).",
            )
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
        return resolve_settings(base, refused, **{k: v for k, v in values.items() if v is not None})

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


_BRANCHES = frozenset({"str", "int", "float", "bool", "dict", "list", "function-after", *_item_tags()})


def plain_errors(errors: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Schema errors as a client reads them: pydantic's branch names and the other shapes' complaints left out.

    Where a field takes several shapes (``input``: text or items), the wrong-type complaints of the shapes it
    did not take are dropped when a closer complaint exists.
    """
    close = [e for e in errors if not str(e.get("type", "")).endswith("_type")] or list(errors)
    return [{**e, "loc": _where(e.get("loc", ()))} for e in close]
