"""The Responses API's input items as wire models: messages and their parts, calls, call outputs, reasoning.

A message holds text (``input_text``, ``output_text``, ``refusal``) and, from a user, ``input_image`` parts;
``function_call`` / ``function_call_output`` items carry a tool round; ``reasoning`` items give an earlier turn's
thinking back; ``item_reference`` (a stored item) is read only to be refused. The ids, statuses and annotations a
client sends back with an item are ignored (:class:`Item`); parts of the request that are not items refuse
unknown fields (:class:`Strict`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag

from ....contract.validation import FirstErrorModel


class Strict(FirstErrorModel):
    """A part of the request whose unknown fields are refused (a typo must not be silently dropped)."""

    model_config = ConfigDict(extra="forbid")


class Item(FirstErrorModel):
    """An input item or part: the ids, statuses and annotations a client sends back with it are ignored."""

    model_config = ConfigDict(extra="ignore")


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


def item_tags() -> tuple[str, ...]:
    """The ``type`` tags of the input items (pydantic names union branches by them)."""
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
