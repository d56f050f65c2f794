"""What the endpoints of one server share: the runtime, its served name and limits, and admission.

Admission counts work in flight (a generation, decoding or waiting, streamed or not, until its response ends; an
embedding or rerank request counts each of its inputs); past ``max_pending`` a request is refused with 503 and
``Retry-After`` before anything runs. :meth:`ServeState.runtime_for` is where a request's ``model`` finds its runtime.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio

from ..chat.formats import without_template
from ..chat.prepare import ChatRequest, PreparedChat, aprepare_chat
from ..contract.api import ModelInfo, Runtime
from ..contract.settings import GenerationSettings
from ..errors import ExLlamaIntegrationsError, ModelNotFoundError, ServerBusyError
from ..model.media import MediaLimits, check_image_count
from ..runtime.base import defaults_of
from .metrics import Metrics

IMAGE_PARTS = frozenset({"image_url", "image", "input_image"})
"""The content-part types that carry an image in the APIs served (chat completions, Messages, Responses)."""


def _image_parts(value: Any) -> int:
    """How many image parts a request body holds, at any depth (without recursion)."""
    n, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            n += item.get("type") in IMAGE_PARTS
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return n


@dataclass(frozen=True)
class ServeLimits:
    """What one server accepts."""

    max_body_bytes: int = 8 * 2**20
    """Largest request body; larger ones get 413."""
    max_tokens: int | None = None
    """Most tokens a request may generate (None: the context decides); a request that sets none gets at most this."""
    max_pending: int = 256
    """Work in flight at once (generations decoding or waiting; each input of an embedding or rerank request); more
    gets 503 with ``Retry-After``."""
    body_timeout: float = 30.0
    """Seconds a client has to send a whole request body; a slower one gets 408 and is disconnected."""
    media: MediaLimits = field(default_factory=MediaLimits)
    """Bounds on a request's images; http(s) image URLs are fetched only with ``fetch_urls``
    (``--allow-image-urls``)."""


@dataclass
class ServeState:
    """One server's shared state (``app.state.serve``)."""

    runtime: Runtime
    name: str
    limits: ServeLimits = field(default_factory=ServeLimits)
    chat_template: str | None = None
    """A template that replaces the model's own on the OpenAI chat endpoint (``serve --chat-template``)."""
    tool_format: str | None = None
    """The tool-call format of every chat request, instead of the model's (``serve --tool-format``)."""
    created: int = 0
    """When the model was loaded (``/v1/models``'s ``created``)."""
    pending: int = 0
    instance: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    """A random name of this server instance (which replica answered), never the pid or a host name."""
    metrics: Any = None
    """The server's Prometheus metrics (:class:`~.metrics.Metrics`), made with the state."""

    def __post_init__(self) -> None:
        if self.metrics is None:
            self.metrics = Metrics(
                self.name,
                lambda: self.pending,
                self._healthy,
                self._restarts,
                running=self.running,
                cache_use=self.cache_use,
            )
        self.metrics.cache_shape(self.cache_use()[1])

    def running(self) -> int:
        """Requests decoding: those the runtime holds, up to its batch (all in flight where it does not say)."""
        active = getattr(self.runtime, "active_requests", None)
        if active is None:
            return self.pending
        try:
            return min(int(active), max(1, self.runtime.model_info().max_batch_size))
        except ExLlamaIntegrationsError:  # closed meanwhile
            return 0

    def cache_use(self) -> tuple[int, int]:
        """KV-cache tokens the requests in flight hold, and the cache's capacity ((0, 0) where none is known)."""
        use = getattr(self.runtime, "cache_use", None)
        if not callable(use):
            return 0, 0
        try:
            return use()  # type: ignore[no-any-return]
        except ExLlamaIntegrationsError:  # closed meanwhile
            return 0, 0

    def _healthy(self) -> int:
        check = getattr(self.runtime, "health", None)
        return 0 if self.runtime.closed or (callable(check) and check() is not None) else 1

    def _restarts(self) -> int:
        """Engine processes started again (0 for a runtime without engine processes)."""
        diagnostics = getattr(self.runtime, "diagnostics", None)
        if self.runtime.closed or not callable(diagnostics):
            return 0
        try:
            engines = diagnostics().get("engines") or []
        except ExLlamaIntegrationsError:
            return 0
        return sum(int(getattr(e, "restarts", 0)) for e in engines)

    @property
    def info(self) -> ModelInfo:
        """The served model's facts (``tool_format``: the one this server reads and writes calls in)."""
        info = self.runtime.model_info()
        if self.tool_format is None:
            return info
        details = {**without_template(info.details), "tool_format_from": "serve --tool-format"}
        return dataclasses.replace(info, tool_format=self.tool_format, details=details)

    @property
    def defaults(self) -> GenerationSettings:
        """The settings a request starts from."""
        return defaults_of(self.runtime)

    async def prepare(self, body: Any, *extra: Any) -> PreparedChat:
        """A chat endpoint's body as its prepared chat, every API alike.

        The model is checked, the body turned into the one chat request (``body.to_chat(defaults, refused,
        max_tokens, chat_template, media limits, *extra)``; images decoded, or fetched where allowed, off the event
        loop) and rendered off it.

        Raises:
            ModelNotFoundError: (404) the body names another model; and whatever the body or the chat refuses.
        """
        self.check_model(body.model)
        limits = self.limits
        if body.has_images():  # counted before any is fetched or decoded
            check_image_count(_image_parts(body.model_dump()), limits.media)
        args: tuple[Any, ...] = (
            self.defaults,
            self.info.unsupported_settings,
            limits.max_tokens,
            self.chat_template,
            limits.media,
            *extra,
        )
        chat = (await asyncio.to_thread(body.to_chat, *args)) if body.has_images() else body.to_chat(*args)
        return await aprepare_chat(self.runtime, self.with_tool_format(chat))

    def with_tool_format(self, chat: ChatRequest) -> ChatRequest:
        """``chat`` in this server's tool-call format (``--tool-format``), where it names none itself."""
        if self.tool_format is None or chat.tool_format is not None:
            return chat
        return dataclasses.replace(chat, tool_format=self.tool_format)

    def check_model(self, model: str | None) -> None:
        """Refuse a request for a model this server does not serve (None: the served one).

        Raises:
            ModelNotFoundError: (404) naming the model it serves.
        """
        if model is not None and model not in (self.name, self.info.name):
            e = ModelNotFoundError(f"model {model!r} is not served here; this server serves {self.name!r}.")
            e.param = "model"
            raise e

    def runtime_for(self, model: str | None) -> Runtime:
        """The runtime that serves ``model`` (None: the served one).

        One model per server here; a server of several models resolves the name in its registry instead.

        Raises:
            ModelNotFoundError: (404) the body names a model this server does not serve.
        """
        self.check_model(model)
        return self.runtime

    def admit(self, work: int = 1) -> None:
        """Count ``work`` more in flight (a generation: 1; an embedding request: its inputs), or refuse it when full.

        A request larger than the whole limit is admitted only when nothing else is in flight (and the limit is not 0).

        Raises:
            ServerBusyError: (503) the server has ``max_pending`` in flight.
        """
        limit = self.limits.max_pending
        if self.pending + work > limit and (self.pending or limit <= 0):
            self.metrics.refuse("busy")
            raise ServerBusyError(f"the server has {self.pending} requests in flight (its limit); retry shortly.")
        self.pending += work

    def release(self, work: int = 1) -> None:
        """``work`` fewer in flight."""
        self.pending -= work

    @contextlib.contextmanager
    def in_flight(self, work: int = 1) -> Iterator[None]:
        """``work`` in flight for the block."""
        self.admit(work)
        try:
            yield
        finally:
            self.release(work)

    async def stream(self, items: AsyncIterator[bytes], close: Any) -> AsyncIterator[bytes]:
        """``items`` while the request counts as in flight; ``close`` (shielded from a disconnect) at the end."""
        try:
            async for b in items:
                yield b
        finally:
            self.release()
            with anyio.CancelScope(shield=True):
                await close()


def record(state: ServeState, scope_state: Any, usage: Any, timings: Any, finish: str | None) -> None:
    """A finished request: what its log line reports (tokens, time to first token) and the server's metrics."""
    ttft = (timings and timings.time_to_first_token) or 0.0
    scope_state.usage = (usage.prompt_tokens, usage.completion_tokens, ttft)
    state.metrics.observe(usage, timings, finish)


def state_of(app: Any) -> ServeState:
    """The server state of an app (or a request's app)."""
    return app.state.serve  # type: ignore[no-any-return]
