"""The Responses API and the one chat: a request to the chat request (:func:`to_chat`, a :class:`~..conversion.ToChat`).

``input`` text or items becomes the conversation in Hugging Face conventions (:func:`messages`): ``instructions``
the system turn, messages their turns (``developer`` a system turn; user images read as images are everywhere),
``function_call`` items the assistant's calls (joining the assistant turn just before), ``function_call_output``
items tool turns, ``reasoning`` items the next assistant turn's earlier thinking. Fields that need state this
server does not keep are refused naming the field. The reply's way back is the stream's (:mod:`.stream`), whose
final response the whole answer is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...chat.content import content_of
from ...chat.prepare import ChatRequest
from ...contract.api import Media
from ...contract.settings import GenerationSettings, resolve_settings
from ...errors import InvalidSettingsError, MediaError
from ...model.media import MediaLimits, media_from_url
from ..conversion import ChatContext
from .protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    InputImage,
    InputText,
    ItemReference,
    MessageItem,
    OutputText,
    ReasoningItem,
    RefusalPart,
    ResponsesRequest,
)


def to_chat(body: ResponsesRequest, context: ChatContext) -> ChatRequest:
    """The chat call as the plain-data chat request every front door uses (images read within ``context.media``).

    Raises:
        InvalidSettingsError: a field that needs server-side state, or bad settings.
        MediaError: an image that cannot be read, or a part this server does not take.
    """
    _check_stateless(body)
    tools = [t.to_chat_tool() for t in body.tools or []]
    choice: Any = body.tool_choice
    if isinstance(choice, FunctionChoice):
        choice = {"type": "function", "function": {"name": choice.name}}
    media: list[Media] = []
    return ChatRequest(
        messages=messages(body, media, context.media),
        settings=_settings(body, context.defaults, context.refused, context.max_tokens),
        tools=tools,
        tool_choice=choice if tools else None,
        response_format=body.text.response_format() if body.text is not None else None,
        template_kwargs=body.reasoning.template_kwargs() if body.reasoning is not None else {},
        chat_template=context.chat_template,
        media=media,
        parallel_tool_calls=body.parallel_tool_calls,
        max_tool_calls=body.max_tool_calls,
    )


def messages(body: ResponsesRequest, media: list[Media], limits: MediaLimits) -> list[dict[str, Any]]:
    """The conversation as template messages (Hugging Face conventions); user images appended to ``media``."""
    out: list[dict[str, Any]] = []
    if body.instructions:
        out.append({"role": "system", "content": body.instructions})
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
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


def _check_stateless(body: ResponsesRequest) -> None:
    """Refuse what needs a stored response, conversation or prompt (this server keeps none).

    Raises:
        InvalidSettingsError: naming the field.
    """
    again = "send the whole conversation as input items (an earlier response's output items included)."
    if body.previous_response_id is not None:
        raise _refuse("previous_response_id", f"this server keeps no responses (as with store: false); {again}")
    if body.conversation is not None:
        raise _refuse("conversation", f"this server keeps no conversations; {again}")
    if body.background:
        raise _refuse("background", "this server answers in the foreground only; send background: false.")
    if body.prompt is not None:
        raise _refuse("prompt", "this server keeps no prompt templates; send the text as input and instructions.")
    if not isinstance(body.input, str) and any(isinstance(i, ItemReference) for i in body.input):
        raise _refuse("input", f"item_reference items need stored items, and this server keeps none; {again}")


def _refuse(field: str, why: str) -> InvalidSettingsError:
    return InvalidSettingsError(f"{field}: {why}", param=field, reason="unsupported_parameter")


def _settings(
    body: ResponsesRequest, defaults: GenerationSettings, refused: Mapping[str, str], max_tokens_cap: int | None
) -> GenerationSettings:
    """The request's settings over the server's defaults, resolved once.

    ``max_tokens_cap`` (``serve --max-tokens``) caps ``max_output_tokens``: more is refused; none gets the cap.
    """
    asked = body.max_output_tokens
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
    values = {"temperature": body.temperature, "top_p": body.top_p, "max_new_tokens": asked}
    if body.wants_logprobs:  # the answer's tokens with their log-probabilities (and top_logprobs alternatives)
        values["logprobs"] = body.top_logprobs or 0
    return resolve_settings(base, refused, **{k: v for k, v in values.items() if v is not None})


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


__all__ = ["messages", "to_chat"]
