"""The conversion every chat API declares: its request body to the one chat request, as ``typing.Protocol`` types.

Chat completions, the Responses API and the Messages API each keep the same roles in files of the same names
(``protocol``: the wire models; ``convert``: a body to the chat request and a reply back to the wire; ``stream``:
the events of a streamed reply; ``endpoint``: the routes). Each ``convert`` module's ``to_chat(body, context)`` is a
:class:`ToChat` of its body, a :class:`ChatBody`; :meth:`~.state.ServeState.prepare` takes the body and that
conversion and gives it the server's :class:`ChatContext` by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from ..chat.prepare import ChatRequest
from ..contract.settings import GenerationSettings
from ..model.media import MediaLimits


@dataclass(frozen=True)
class ChatContext:
    """What a body is converted with: the server's settings, limits and template."""

    defaults: GenerationSettings
    """The settings a request starts from."""
    refused: Mapping[str, str] = field(default_factory=dict)
    """Settings the backend cannot honour, each with why (``ModelInfo.unsupported_settings``)."""
    max_tokens: int | None = None
    """``serve --max-tokens``: the most a generation may ask for, and what one that asks for none gets."""
    chat_template: str | None = None
    """A template that replaces the model's own (``serve --chat-template``)."""
    media: MediaLimits = field(default_factory=MediaLimits)
    """Bounds on a request's images."""
    thinking_switch: bool = False
    """Whether the template reads ``enable_thinking`` (chat completions' ``reasoning_effort`` sets it)."""


class ChatBody(Protocol):
    """A chat endpoint's request body, whichever API's."""

    @property
    def model(self) -> str | None:
        """The model it asks for (None: the served one)."""
        ...

    def has_images(self) -> bool:
        """Whether it holds images (reading them may fetch: its conversion then runs off the event loop)."""
        ...

    def model_dump(self) -> dict[str, Any]:
        """Its fields as plain data (its image parts are counted there before any is read)."""
        ...


BodyT = TypeVar("BodyT", bound=ChatBody, contravariant=True)


class ToChat(Protocol[BodyT]):
    """An API's conversion of its body to the one chat request (its ``convert.to_chat``).

    Raises (when called): InvalidSettingsError, MediaError and the other typed errors of what the body asks.
    """

    def __call__(self, body: BodyT, context: ChatContext, /) -> ChatRequest: ...


__all__ = ["ChatBody", "ChatContext", "ToChat"]
