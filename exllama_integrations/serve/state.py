"""What the endpoints of one server share: the runtime, its served name and limits, and admission.

Admission counts work in flight: a generation, decoding or waiting, streamed or not (a completions request of 4
prompts with ``n`` 2 is 8; a chat request with ``n`` 3 is 3; ``/tokenize`` and ``count_tokens``, which render and
tokenize as a generation does, 1); each input of an embedding or rerank request. A request is admitted before its
body is prepared (templates rendered, text tokenized, images fetched) and counts until its response has been sent;
past ``max_pending`` it is refused with 503 and ``Retry-After`` before anything of it runs (one larger than the
whole limit runs only alone). ``max_tokens`` (``serve --max-tokens``) bounds each generation.
:meth:`ServeState.runtime_for` is where a request's ``model`` finds its runtime.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..chat.formats import without_template
from ..chat.prepare import ChatRequest, PreparedChat, aprepare_chat
from ..contract.api import ModelInfo, Runtime
from ..contract.settings import GenerationSettings
from ..errors import ExLlamaIntegrationsError, MediaError, ModelNotFoundError, ServerBusyError
from ..model.media import MediaLimits, check_image_count
from ..runtime.base import defaults_of
from .conversion import ChatBody, ChatContext, ToChat
from .metrics import Metrics

B = TypeVar("B", bound=ChatBody)

IMAGE_PARTS = frozenset({"image_url", "image", "input_image"})
"""The content-part types that carry an image in the APIs served (chat completions, Messages, Responses)."""


def image_parts(value: Any) -> int:
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
    """Most tokens each generation may produce (each of a request's ``n`` choices and prompts; None: the context
    decides); a request that sets none gets at most this, one that asks for more is refused."""
    max_pending: int = 256
    """Work in flight at once (generations decoding, waiting or being prepared, a request counting as its prompts
    times ``n``; each input of an embedding or rerank request); more gets 503 with ``Retry-After``."""
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

    async def prepare(self, body: B, to_chat: ToChat[B], *, thinking_switch: bool = False) -> PreparedChat:
        """A chat endpoint's body as its prepared chat, every API alike.

        The model is checked, the body turned into the one chat request by its API's conversion (``to_chat``, given
        this server's :class:`~.conversion.ChatContext`; images decoded, or fetched where allowed, off the event
        loop) and rendered off it. ``thinking_switch``: the template reads ``enable_thinking``.

        Raises:
            ModelNotFoundError: (404) the body names another model; and whatever the body or the chat refuses.
        """
        self.check_model(body.model)
        limits = self.limits
        if body.has_images():  # refused, or counted, before any is fetched or decoded
            self.check_images(image_parts(body.model_dump()))
        context = ChatContext(
            defaults=self.defaults,
            refused=self.info.unsupported_settings,
            max_tokens=limits.max_tokens,
            chat_template=self.chat_template,
            media=limits.media.for_request(),  # the request's images' bytes counted as they are read
            thinking_switch=thinking_switch,
        )
        chat = (await asyncio.to_thread(to_chat, body, context)) if body.has_images() else to_chat(body, context)
        return await aprepare_chat(self.runtime, self.with_tool_format(chat))

    def check_images(self, n: int) -> None:
        """Refuse a request's ``n`` images before any is fetched or decoded: the model takes none, or too many.

        Raises:
            MediaError: (400) the served model takes no images, or ``n`` is over the server's ``max_images``.
        """
        info = self.info
        if not info.accepts_images:
            why = info.details.get("vision") or "it has no vision component"
            raise MediaError(f"{info.name!r} takes no images: {why}; send text only.")
        check_image_count(n, self.limits.media)

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

    def _take(self, work: int) -> None:
        """Count ``work`` more in flight, or refuse it (one larger than the whole limit only when nothing runs)."""
        limit = self.limits.max_pending
        if self.pending + work > limit and (self.pending or limit <= 0):
            self.metrics.refuse("busy")
            raise ServerBusyError(
                f"the server has {self.pending} in flight and this request asks for {work} more (its limit is "
                f"{limit}); retry shortly."
            )
        self.pending += work

    def admit(self, scope_state: Any, work: int = 1) -> None:
        """Count a request's ``work`` (its generations) in flight until its response has been sent, or refuse it.

        Called first by every endpoint that prepares or generates (before its body is rendered, tokenized or its
        images fetched); ``scope_state`` is the request's ``request.state``, where the guard finds what to release
        once the response has been sent (streamed or not, or failed). A request admitted already is not counted
        again.

        Raises:
            ServerBusyError: (503) the server has too much in flight to take this request's now.
        """
        if getattr(scope_state, "release", None) is not None:
            return
        self._take(work)
        released = [False]

        def release() -> None:
            if not released[0]:
                released[0] = True
                self.release(work)

        scope_state.release = release

    def release(self, work: int = 1) -> None:
        """``work`` fewer in flight."""
        self.pending -= work

    @contextlib.contextmanager
    def in_flight(self, work: int = 1) -> Iterator[None]:
        """``work`` in flight for the block (an embedding or rerank request's inputs)."""
        self._take(work)
        try:
            yield
        finally:
            self.release(work)


def record(
    state: ServeState, scope_state: Any, usage: Any, timings: Any, finish: str | None, new_prompt: bool = True
) -> None:
    """A finished generation: what its request's log line reports and the server's metrics.

    A request of several generations (``n`` choices, a list of prompts) is recorded once per generation: the log
    line sums them (the earliest first token), and a prompt is counted once however many choices read it
    (``new_prompt``: False for the second choice of a prompt and after).
    """
    if not new_prompt:
        usage = dataclasses.replace(usage, prompt_tokens=0, cached_tokens=0)
    ttft = (timings and timings.time_to_first_token) or 0.0
    before = getattr(scope_state, "usage", None)
    if before is not None:
        ttft = min(t for t in (before[2], ttft) if t) if before[2] or ttft else 0.0
        scope_state.usage = (before[0] + usage.prompt_tokens, before[1] + usage.completion_tokens, ttft)
    else:
        scope_state.usage = (usage.prompt_tokens, usage.completion_tokens, ttft)
    state.metrics.observe(usage, timings, finish)


def state_of(app: Any) -> ServeState:
    """The server state of an app (or a request's app)."""
    return app.state.serve  # type: ignore[no-any-return]
