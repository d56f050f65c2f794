"""ExLlamaRuntime: one loaded model (backend + tokenizer), shared by every wrapper built on it."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ContextLengthError, InvalidSettingsError, RuntimeClosedError
from .backends import BackendOptions, BackendRequest, TokenLogprob, resolve_backend
from .model_dir import ModelDirectory
from .settings import GenerationSettings
from .streaming import IncrementalDetokenizer, StopStringMatcher
from .tokenizer import NativeTokenizer

if TYPE_CHECKING:
    from .backends.base import Backend
    from .constraints import TokenConstraint

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Usage:
    """Token counts of one generation, from the native tokenizer."""

    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        """Prompt plus completion tokens."""
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Timings:
    """Wall-clock timings of one generation, in seconds."""

    time_to_first_token: float | None
    total: float
    tokens_per_second: float | None
    """Decode speed: tokens after the first, over the time after the first."""


@dataclass(frozen=True)
class GenerationChunk:
    """A piece of streamed output. The last chunk of a stream carries ``finish_reason`` and ``usage``."""

    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    stop_string: str | None = None
    constraint_complete: bool | None = None


@dataclass(frozen=True)
class GenerationResult:
    """A finished generation."""

    text: str
    finish_reason: str
    usage: Usage
    timings: Timings
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None
    stop_string: str | None = None
    backend: str = ""
    constraint_complete: bool | None = None
    """With a constraint: whether the output is complete under it (False: cut short, e.g. by max_new_tokens)."""

    def info(self) -> dict[str, Any]:
        """A flat dict for framework metadata (LangChain generation_info, LlamaIndex raw)."""
        d: dict[str, Any] = {
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.usage.prompt_tokens,
            "completion_tokens": self.usage.completion_tokens,
            "total_tokens": self.usage.total_tokens,
            "time_to_first_token": self.timings.time_to_first_token,
            "tokens_per_second": self.timings.tokens_per_second,
            "backend": self.backend,
        }
        if self.stop_string is not None:
            d["stop_string"] = self.stop_string
        if self.constraint_complete is not None:
            d["constraint_complete"] = self.constraint_complete
        return d


class GenerationStream(Iterator[GenerationChunk]):
    """Iterator over a generation's chunks; closing it (or ``break``) cancels the generation.

    After it is exhausted, :attr:`result` holds the :class:`GenerationResult`.
    """

    def __init__(self, gen: Iterator[GenerationChunk], cancel: threading.Event) -> None:
        self._gen = gen
        self._cancel = cancel
        self.result: GenerationResult | None = None

    def __iter__(self) -> GenerationStream:
        return self

    def __next__(self) -> GenerationChunk:
        return next(self._gen)

    def cancel(self) -> None:
        """Ask the generation to stop at its next step (safe from any thread)."""
        self._cancel.set()

    def close(self) -> None:
        """Stop the generation now and free its backend resources."""
        self._cancel.set()
        self._gen.close()  # type: ignore[attr-defined]

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


# --------------------------------------------------------------------------- registry

_registry: dict[tuple[Any, ...], weakref.ref[ExLlamaRuntime]] = {}
_registry_lock = threading.Lock()
_key_locks: dict[tuple[Any, ...], threading.Lock] = {}


def _options_key(options: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k, repr(v)) for k, v in options.items() if v is not None))


class ExLlamaRuntime:
    """One model directory loaded once: backend, tokenizer and generation, shared by wrappers.

    Build it directly for a private runtime, or with :meth:`shared` to get the same loaded runtime
    for every caller asking for the same directory and options (what the LangChain and LlamaIndex
    wrappers do). Safe to call from many threads and from asyncio at once.

    Example:
        >>> rt = ExLlamaRuntime.shared("~/models/SmolLM2-135M-Instruct")  # doctest: +SKIP
        >>> rt.generate("The capital of France is", temperature=0, max_new_tokens=8).text  # doctest: +SKIP
        ' Paris.'
        >>> for chunk in rt.stream("Once upon a time", max_new_tokens=16):  # doctest: +SKIP
        ...     print(chunk.text, end="")
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        backend: str = "auto",
        *,
        max_seq_len: int | None = None,
        dtype: str | None = None,
        device: str | None = None,
        settings: GenerationSettings | None = None,
        **backend_options: Any,
    ) -> None:
        """Load ``model_dir`` with ``backend`` (``auto``, ``exllamav3``, ``exllama``, ``exllamav2``, ``transformers``).

        Raises:
            ModelLoadError: (ModelNotFoundError, InvalidModelError, UnsupportedModelError) the directory
                cannot be loaded; nothing stays loaded.
            MissingDependencyError: the backend's extra is not installed.
            BackendUnavailableError: the backend cannot run on this machine.
        """
        self.model = ModelDirectory.inspect(model_dir)
        backend_cls = resolve_backend(backend, self.model)
        self.tokenizer = NativeTokenizer(self.model)
        self.options = BackendOptions(
            max_seq_len=max_seq_len, dtype=dtype, device=device, extra=tuple(sorted(backend_options.items()))
        )
        self.settings = settings or GenerationSettings()
        t0 = time.perf_counter()
        self._backend: Backend | None = backend_cls(self.model, self.tokenizer, self.options)
        self.backend_name = backend_cls.name
        self.concurrent = backend_cls.concurrent
        self.load_seconds = time.perf_counter() - t0
        self._closed = False
        self._key: tuple[Any, ...] | None = None
        self._active: set[threading.Event] = set()
        self._active_lock = threading.Lock()
        logger.info("loaded %s on %s in %.1fs", self.model.name, self.backend_name, self.load_seconds)

    # ----------------------------------------------------------------- sharing

    @classmethod
    def shared(cls, model_dir: str | os.PathLike[str], backend: str = "auto", **options: Any) -> ExLlamaRuntime:
        """The loaded runtime for this directory and options, loading it on first use.

        Every caller with the same (resolved) directory, backend and options gets the same object,
        so an LLM, a chat model and a LlamaIndex LLM on one directory load the weights once.
        """
        path = os.path.realpath(os.path.expanduser(os.fspath(model_dir)))
        key = (path, backend, _options_key(options))
        with _registry_lock:
            ref = _registry.get(key)
            rt = ref() if ref else None
            if rt is not None and not rt.closed:
                return rt
            key_lock = _key_locks.setdefault(key, threading.Lock())
        with key_lock:  # one loader per key; others wait and reuse
            with _registry_lock:
                ref = _registry.get(key)
                rt = ref() if ref else None
                if rt is not None and not rt.closed:
                    return rt
            rt = cls(model_dir, backend, **options)
            rt._key = key
            with _registry_lock:
                _registry[key] = weakref.ref(rt)
            return rt

    @staticmethod
    def loaded() -> list[ExLlamaRuntime]:
        """Shared runtimes currently loaded."""
        with _registry_lock:
            return [r for r in (ref() for ref in _registry.values()) if r is not None and not r.closed]

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def close(self) -> None:
        """Cancel running generations and free the model (GPU memory included). Idempotent."""
        if self._closed:
            return
        self._closed = True
        with self._active_lock:
            for ev in self._active:
                ev.set()
        if self._key is not None:
            with _registry_lock:
                ref = _registry.get(self._key)
                if ref is not None and ref() is self:
                    del _registry[self._key]
        backend, self._backend = self._backend, None
        if backend is not None:
            backend.close()
        logger.info("closed %s (%s)", self.model.name, self.backend_name)

    def __enter__(self) -> ExLlamaRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "loaded"
        return f"ExLlamaRuntime({str(self.model.path)!r}, backend={self.backend_name!r}, {state})"

    # ----------------------------------------------------------------- facts

    @property
    def context_length(self) -> int:
        """Longest prompt + completion the loaded model (and its cache) can hold."""
        return self._require_backend().context_length

    @property
    def model_name(self) -> str:
        """The model directory's name."""
        return self.model.name

    def info(self) -> dict[str, Any]:
        """Backend, model and context facts."""
        return {
            "model_name": self.model_name,
            "model_dir": str(self.model.path),
            "context_length": self.context_length,
            **self._require_backend().info(),
        }

    def count_tokens(self, text: str) -> int:
        """Number of tokens in ``text`` by the native tokenizer (no BOS)."""
        return self.tokenizer.count(text)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text`` by the native tokenizer."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render chat messages with the model's own template (sandboxed).

        Stream the result with ``add_special_tokens=False``: the template carries its own BOS.
        """
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, **template_kwargs
        )

    def _require_backend(self) -> Backend:
        if self._closed or self._backend is None:
            raise RuntimeClosedError(
                f"the runtime for {self.model.name!r} was closed; build a new one to load it again."
            )
        return self._backend

    # ----------------------------------------------------------------- generation

    def resolve_settings(self, settings: GenerationSettings | None = None, **overrides: Any) -> GenerationSettings:
        """The runtime's defaults, then ``settings``, then ``overrides`` (None ignored)."""
        base = settings or self.settings
        unknown = set(overrides) - set(GenerationSettings.model_fields)
        if unknown:
            raise InvalidSettingsError(
                f"unknown generation setting(s): {', '.join(sorted(unknown))}; "
                f"valid ones are {', '.join(GenerationSettings.model_fields)}."
            )
        return base.merged(**overrides) if overrides else base

    def _prompt_ids(self, prompt: str | Sequence[int], add_special_tokens: bool) -> list[int]:
        if isinstance(prompt, str):
            if prompt == "":
                raise InvalidSettingsError("the prompt is empty; pass some text to complete.")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidSettingsError(
                    "the prompt holds text that is not valid UTF-8 (lone surrogates, e.g. from bytes decoded "
                    "with 'surrogateescape'); decode the input with errors='replace' first."
                ) from None
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if isinstance(prompt, (bytes, bytearray)):
            raise InvalidSettingsError("the prompt is bytes; decode it to str first (e.g. data.decode('utf-8')).")
        ids = list(prompt)
        if not ids:
            raise InvalidSettingsError("the prompt has no tokens.")
        if not all(isinstance(i, int) and 0 <= i < self.tokenizer.vocab_size for i in ids):
            raise InvalidSettingsError(f"prompt token ids must be ints in [0, {self.tokenizer.vocab_size}).")
        return ids

    def _fit(self, ids: list[int], s: GenerationSettings) -> tuple[list[int], int]:
        ctx = self.context_length
        want = s.max_new_tokens
        if want is None:
            if len(ids) >= ctx:
                if not s.truncate_prompt:
                    raise ContextLengthError(len(ids), 1, ctx)
                ids = ids[-(ctx - 1) :]
            return ids, ctx - len(ids)
        if want >= ctx:
            raise ContextLengthError(len(ids), want, ctx)
        if len(ids) + want > ctx:
            if not s.truncate_prompt:
                raise ContextLengthError(len(ids), want, ctx)
            ids = ids[-(ctx - want) :]
        return ids, want

    def stream(
        self,
        prompt: str | Sequence[int],
        settings: GenerationSettings | None = None,
        *,
        constraint: TokenConstraint | None = None,
        add_special_tokens: bool = True,
        **overrides: Any,
    ) -> GenerationStream:
        """Stream a completion of ``prompt`` (text, or token ids) chunk by chunk.

        Overrides are generation settings (``temperature=0``, ``stop=[...]``, ...). Breaking out of
        the loop or closing the stream cancels the generation within one decoding step.

        Raises:
            InvalidSettingsError: bad settings, empty or non-UTF-8 prompt.
            ContextLengthError: prompt + max_new_tokens exceed the context.
            RuntimeClosedError: the runtime was closed.
        """
        backend = self._require_backend()
        s = self.resolve_settings(settings, **overrides)
        ids = self._prompt_ids(prompt, add_special_tokens)
        ids, max_new = self._fit(ids, s)
        if constraint is not None:
            constraint.start()
        stop_ids = frozenset(s.stop_token_ids) | (
            frozenset() if s.ignore_eos else frozenset(self.tokenizer.eos_token_ids)
        )
        cancel = threading.Event()
        request = BackendRequest(ids, s, max_new, stop_ids, cancel, constraint)
        stream = GenerationStream(iter(()), cancel)
        stream._gen = self._run(backend, request, stream)
        return stream

    def _run(self, backend: Backend, req: BackendRequest, stream: GenerationStream) -> Iterator[GenerationChunk]:
        s = req.settings
        detok = IncrementalDetokenizer(self.tokenizer)
        matcher = StopStringMatcher(s.stop)
        t0 = time.perf_counter()
        t_first: float | None = None
        t_last = t0
        n = 0
        produced: list[int] = []
        logprobs: list[TokenLogprob] = []
        emitted: list[str] = []
        finish = "length"
        stop_string: str | None = None
        with self._active_lock:
            self._active.add(req.cancel)
        steps = backend.generate(req)
        try:
            for step in steps:
                now = time.perf_counter()
                if t_first is None:
                    t_first = now
                t_last = now
                ended = False
                visible: list[int] = []
                for tid in step.token_ids:
                    n += 1
                    if tid in req.stop_token_ids:
                        ended = True
                        finish = "stop" if tid in s.stop_token_ids else "eos"
                        break
                    visible.append(tid)
                produced.extend(visible)
                step_lp = tuple(step.logprobs[: len(visible)]) if step.logprobs else None
                if step_lp:
                    logprobs.extend(step_lp)
                text = matcher.push(detok.add(visible)) if visible else ""
                if matcher.stopped is not None:
                    finish, stop_string, ended = "stop", matcher.stopped, True
                if text or (step_lp and not ended):
                    emitted.append(text)
                    yield GenerationChunk(text, tuple(visible), step_lp)
                if ended:
                    break
                if req.cancel.is_set():
                    finish = "cancelled"
                    break
            else:
                if req.cancel.is_set():
                    finish = "cancelled"
                elif n < req.max_new_tokens:
                    finish = "eos"  # the backend ended on a stop token it did not pass on
        finally:
            req.cancel.set()
            steps.close()  # type: ignore[attr-defined]
            with self._active_lock:
                self._active.discard(req.cancel)
        tail = ""
        if matcher.stopped is None:
            tail = matcher.push(detok.flush())
            if matcher.stopped is not None:  # a stop string completed in the last held-back bytes
                finish, stop_string = "stop", matcher.stopped
            else:
                tail += matcher.flush()
        emitted.append(tail)
        total = time.perf_counter() - t0
        tps = (n - 1) / (t_last - t_first) if (t_first is not None and n > 1 and t_last > t_first) else None
        timings = Timings(None if t_first is None else t_first - t0, total, tps)
        usage = Usage(len(req.prompt_ids), n)
        complete = req.constraint.is_accepting() if req.constraint is not None else None
        stream.result = GenerationResult(
            text="".join(emitted),
            finish_reason=finish,
            usage=usage,
            timings=timings,
            token_ids=tuple(produced),
            logprobs=tuple(logprobs) if s.logprobs is not None else None,
            stop_string=stop_string,
            backend=self.backend_name,
            constraint_complete=complete,
        )
        yield GenerationChunk(tail, (), None, finish, usage, timings, stop_string, complete)

    def generate(
        self,
        prompt: str | Sequence[int],
        settings: GenerationSettings | None = None,
        *,
        constraint: TokenConstraint | None = None,
        add_special_tokens: bool = True,
        **overrides: Any,
    ) -> GenerationResult:
        """Generate a whole completion (the stream, collected)."""
        stream = self.stream(
            prompt, settings, constraint=constraint, add_special_tokens=add_special_tokens, **overrides
        )
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def batch(
        self,
        prompts: Iterable[str | Sequence[int]],
        settings: GenerationSettings | None = None,
        *,
        add_special_tokens: bool = True,
        **overrides: Any,
    ) -> list[GenerationResult]:
        """Generate completions for several prompts; concurrent backends run them as one dynamic batch.

        Settings are validated once, before any prompt runs.
        """
        items = list(prompts)
        s = self.resolve_settings(settings, **overrides)
        if not items:
            return []

        def one(p: str | Sequence[int]) -> GenerationResult:
            return self.generate(p, s, add_special_tokens=add_special_tokens)

        if not self.concurrent or len(items) == 1:
            return [one(p) for p in items]
        with ThreadPoolExecutor(max_workers=min(len(items), 64), thread_name_prefix="exllama-batch") as pool:
            return list(pool.map(one, items))

    async def astream(
        self,
        prompt: str | Sequence[int],
        settings: GenerationSettings | None = None,
        *,
        constraint: TokenConstraint | None = None,
        add_special_tokens: bool = True,
        **overrides: Any,
    ) -> AsyncIterator[GenerationChunk]:
        """Async :meth:`stream`: decoding runs on a worker thread, so the event loop stays free.

        Cancelling the consuming task (or closing the async generator) cancels the generation.
        """
        stream = self.stream(
            prompt, settings, constraint=constraint, add_special_tokens=add_special_tokens, **overrides
        )
        async for chunk in _aiter_stream(stream):
            yield chunk

    async def agenerate(
        self,
        prompt: str | Sequence[int],
        settings: GenerationSettings | None = None,
        *,
        constraint: TokenConstraint | None = None,
        add_special_tokens: bool = True,
        **overrides: Any,
    ) -> GenerationResult:
        """Async :meth:`generate`, not blocking the event loop."""
        stream = self.stream(
            prompt, settings, constraint=constraint, add_special_tokens=add_special_tokens, **overrides
        )
        async for _ in _aiter_stream(stream):
            pass
        assert stream.result is not None
        return stream.result


async def _aiter_stream(stream: GenerationStream) -> AsyncIterator[GenerationChunk]:
    """Drive a sync stream on a worker thread, handing chunks to the event loop as they come."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()
    done = object()

    def put(item: Any) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            stream.cancel()

    def produce() -> None:
        try:
            for chunk in stream:
                put(chunk)
            put(done)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            put(e)
        finally:
            stream.close()

    worker = threading.Thread(target=produce, name="exllama-astream", daemon=True)
    worker.start()
    try:
        while True:
            item = await queue.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stream.cancel()


__all__ = [
    "ExLlamaRuntime",
    "GenerationChunk",
    "GenerationResult",
    "GenerationStream",
    "Timings",
    "Usage",
]
