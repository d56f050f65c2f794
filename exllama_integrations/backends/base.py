"""The backend contract, on one page: the only place that knows an inference library exists.

A backend turns requests (prompt ids, settings, a grammar matcher, a reasoning control, a cancel signal)
into token steps, delivered to each request's ``emit`` from the backend's own worker thread. It never
blocks its caller and never waits for a reader: a reader that stops reading holds nothing. The backend
owns the grammar state (it masks with the request's matcher and feeds it what it sampled, only once the
reasoning control says the answer began) and writes the tokens the control forces. Detokenizing, stop
strings, the reasoning split, usage and timing happen once, in the runtime.

Rules every backend keeps:

* ``submit`` returns at once; every submitted request gets steps and exactly one final step
  (``finish`` set), also when it is cancelled, when the backend fails, and when it is closed.
* The last token of a step with ``finish="stop_token"`` is one of ``request.stop_token_ids``.
* ``request.cancel`` is checked before each step; a cancelled request ends within one step.
* ``close()`` stops taking requests, cancels the ones it has, waits for the step in flight, and
  only then frees weights and cache, so no step runs on freed memory. It always returns.
* Load options are a typed :class:`BackendOptions` subclass (unknown keys are refused by name), and
  settings a backend cannot honour are listed in ``unsupported_settings`` (refused when set, before
  anything runs).
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..contract.settings import GenerationSettings
from ..errors import InvalidSettingsError, MediaError, MissingDependencyError, UnsupportedModelError
from ..model.directory import ModelDirectory

if TYPE_CHECKING:
    from ..contract.api import Grammar, Reasoning
    from ..model.grammar import ConstraintMatcher
    from ..model.tokenizer import NativeTokenizer

StepFinish = Literal["stop_token", "length", "end", "cancelled", "error"]
"""Why a backend ended a request: its last token is a stop id; max_new_tokens; the backend ended it
for a reason equal to end-of-sequence (e.g. a completed grammar); cancelled; or it failed (``error``)."""


@dataclass(frozen=True)
class RawLogprob:
    """A chosen token's log-probability and the top alternatives, as ids (the runtime adds the text)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TokenStep:
    """Tokens produced by one decoding step (usually one), and, on the last step, why it ended."""

    token_ids: tuple[int, ...] = ()
    logprobs: tuple[RawLogprob, ...] | None = None
    finish: StepFinish | None = None
    error: BaseException | None = None
    cached: int | None = None
    """Prompt tokens the backend reused from its prefix cache (None: it does not say here). exllamav3 says on the
    first step that carries tokens (its pages are matched before the first token) and again on the last."""
    accepting: bool | None = None
    """On the last step of a constrained request whose matcher lives elsewhere (an engine process): whether
    the grammar accepted the output (None: the runtime asks the request's matcher)."""
    prompt_logprobs: tuple[RawLogprob, ...] | None = None
    """On the first step, with ``settings.prompt_logprobs``: each prompt token's logprob given the ones before it
    (the first token's 0.0, with no alternatives)."""
    drafted: tuple[int, int] | None = None
    """On the last step of a request a drafter served (speculative decoding, MTP heads): its drafted tokens the
    target accepted and rejected (None: nothing was drafted for it, or the backend does not say)."""


class CancelSignal(threading.Event):
    """A request's cancel flag: a :class:`threading.Event` that also calls back whoever must pass it on.

    A backend in another process registers :meth:`on_set` to send the cancellation over its channel at once,
    instead of polling every open request's flag.
    """

    def __init__(self) -> None:
        super().__init__()
        self._callbacks: list[Callable[[], None]] = []

    def on_set(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when the flag is set (at once if it already is)."""
        self._callbacks.append(callback)
        if self.is_set():
            callback()

    def set(self) -> None:
        first = not self.is_set()
        super().set()
        if first:
            for cb in self._callbacks:
                cb()


class Steering(Protocol):
    """A reasoning request's control, as a backend uses it (the runtime's ``ReasoningControl``).

    The backend calls :meth:`observe` with every token it produced, in order; writes :meth:`forced` tokens
    next instead of sampling; and applies (and feeds) the grammar only while :attr:`constrained`.
    """

    end_ids: tuple[int, ...]
    reasoning: Reasoning
    """The delimiters and the budget (what a backend in another process builds its own control from)."""

    @property
    def constrained(self) -> bool: ...

    def observe(self, token_ids: Sequence[int]) -> None: ...

    def forced(self) -> tuple[int, ...]: ...

    def twin(self) -> Steering: ...


@dataclass(eq=False)
class BackendRequest:
    """One generation as a backend sees it."""

    prompt_ids: list[int]
    settings: GenerationSettings
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    emit: Callable[[TokenStep], None]
    """Called from the backend's thread with each step; the runtime feeds the grammar inside it, so the
    next mask is ready when it returns."""
    cancel: CancelSignal = field(default_factory=CancelSignal)
    constraint: ConstraintMatcher | None = None
    """This generation's grammar matcher, owned by the backend: it masks with it and feeds it what it sampled
    (logits-level backends in their sampler, exllamav3 as the job's filter); the runtime only reads it."""
    steering: Steering | None = None
    """A reasoning request's control (thinking budget, grammar after thinking); None for other requests."""
    embeddings: Any = None
    """Media for the backend (image embeddings' source), when the request has any."""
    grammar: Grammar | None = None
    """The grammar ``constraint`` was compiled from (a backend in another process compiles it again there)."""


class BackendOptions(BaseModel):
    """Load options every backend takes; each backend extends this with its own (unknown keys refused)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_seq_len: int | None = Field(default=None, ge=16)
    """Context (cache) length to allocate; None: the model's, capped by the backend's default."""
    dtype: str | None = None
    """Weights dtype, for backends that take one."""
    device: str | None = None
    """Device, for backends that take one (``cpu``, ``cuda:0``)."""

    def key(self) -> str:
        """A canonical form, for the shared-runtime registry."""
        return self.model_dump_json()

    @classmethod
    def unless_given(cls, given: Iterable[str], defaults: Mapping[str, Any]) -> dict[str, Any]:
        """Of ``defaults``, those this backend has an option for and that ``given`` does not name."""
        named = set(given)
        return {k: v for k, v in defaults.items() if k in cls.model_fields and k not in named}


def gpu_share_options(share: float) -> dict[str, Any]:
    """The options of a runtime that loads beside others on the same GPUs, with ``share`` of them.

    Its ``memory_share``, so that a cache sized from the free memory (``cache_size="auto"``) leaves the others theirs.
    """
    return {"memory_share": share} if 0 < share < 1 else {}


def build_options(cls: type[BackendOptions], backend: str, values: Mapping[str, Any]) -> BackendOptions:
    """Validate load options for ``backend``; an unknown key is named with its closest match.

    Raises:
        InvalidSettingsError: an unknown or invalid option.
    """
    clean = {k: v for k, v in values.items() if v is not None}
    known = list(cls.model_fields)
    unknown = [k for k in clean if k not in known]
    if unknown:
        hints = []
        for k in unknown:
            close = difflib.get_close_matches(k, known, n=1)
            hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise InvalidSettingsError(
            f"unknown option(s) for backend {backend!r}: {', '.join(hints)}; it takes {', '.join(known)}."
        )
    try:
        return cls(**clean)
    except ValidationError as e:
        lines = [
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']} (got {err.get('input')!r})" for err in e.errors()
        ]
        raise InvalidSettingsError(f"invalid option(s) for backend {backend!r}: " + "; ".join(lines)) from None


def require(module: str, extra: str, purpose: str) -> Any:
    """Import an optional module or raise MissingDependencyError naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if e.name and e.name.split(".")[0] != module.split(".")[0]:
            raise  # the library is there but one of *its* imports failed: show that
        raise MissingDependencyError(module, extra, purpose) from None


def cuda_available() -> bool:
    """Whether torch is installed and sees a CUDA device (imports torch only if it is installed)."""
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


class Backend(ABC):
    """A loaded model on one inference library."""

    name: ClassVar[str]
    """Name used in ``backend=`` and logs (and the pip extra that installs it)."""
    Options: ClassVar[type[BackendOptions]] = BackendOptions
    """Its load options."""
    unsupported_settings: ClassVar[Mapping[str, str]] = {}
    """Generation settings it cannot honour, each with the reason shown when one is set."""

    @classmethod
    @abstractmethod
    def check_available(cls) -> None:
        """Raise MissingDependencyError / BackendUnavailableError if it cannot run on this machine."""

    @classmethod
    @abstractmethod
    def check_model(cls, model: ModelDirectory) -> None:
        """Raise UnsupportedModelError (before anything is loaded) if it cannot run this model."""

    @classmethod
    def resolve_options(cls, options: BackendOptions) -> BackendOptions:
        """Options with the backend's defaults filled in (so equal loads share one registry entry)."""
        return options

    @abstractmethod
    def __init__(self, model: ModelDirectory, tokenizer: NativeTokenizer, options: BackendOptions) -> None:
        """Load the model. On failure, free whatever was allocated before raising."""

    @property
    @abstractmethod
    def context_length(self) -> int:
        """Longest prompt + completion this loaded model can hold."""

    @property
    def max_batch_size(self) -> int:
        """How many requests decode together (1: one at a time)."""
        return 1

    @abstractmethod
    def submit(self, requests: Sequence[BackendRequest]) -> None:
        """Start decoding ``requests`` (together, where the backend batches); returns at once."""

    def expect(self, n: int) -> None:  # noqa: B027 - optional: backends that batch on arrival override it
        """``n`` requests of one batch will be submitted one by one, soon: a backend that batches may wait for them."""

    @abstractmethod
    def close(self) -> None:
        """Cancel what runs, wait for the step in flight, then free the model. Idempotent; always returns."""

    def info(self) -> dict[str, Any]:
        """Facts about the loaded model for metadata and logs."""
        return {}

    def health(self) -> str | None:
        """Why this backend cannot take requests now (an engine process restarting), or None when it can."""
        return None

    vision: str | None = "it has no vision component"
    """Why this loaded model takes no images, or None when it takes them (its vision component is loaded)."""

    progress: float = 0.0
    """When (``time.monotonic()``) the driver last made progress inside a step: a backend whose one step can take
    long (a prefill of thousands of tokens on a CPU, run a chunk at a time) sets it between chunks, so the engine's
    watchdog, which counts the time since the last step, sees a driver at work, not a stalled one."""

    def encode_media(
        self, text: str, images: list[Any], add_special_tokens: bool, keys: Sequence[str]
    ) -> tuple[list[int], Any]:
        """A prompt with images: its ids, each image's placeholder expanded, and what the backend needs for them.

        The ids count each image as the tokens the model reads it as; the second value travels in
        :attr:`BackendRequest.embeddings` to this backend's prefill. ``keys`` name the images' bytes (a
        backend may cache what it computed for a picture under them).

        Raises:
            MediaError: the model takes no images, or the prompt does not place them.
        """
        raise MediaError(f"this model takes no images on backend {self.name!r}: {self.vision}; send text only.")

    def library_objects(self) -> dict[str, Any]:
        """The inference library's own objects (model, cache, generator ...), for tests and benchmarks only."""
        return {}


def fail_all(requests: Sequence[BackendRequest], error: BaseException | None = None) -> None:
    """End every request at once: with ``error`` if given, else as cancelled."""
    for r in requests:
        r.emit(TokenStep(finish="error" if error is not None else "cancelled", error=error))


def unsupported(backend: str, model: ModelDirectory, why: str) -> UnsupportedModelError:
    """A consistent UnsupportedModelError."""
    return UnsupportedModelError(f"backend {backend!r} cannot run {model.name!r}: {why}")
