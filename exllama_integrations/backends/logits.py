"""Decoding for backends that hand us logits (CPU reference, ExLlama v1 and v2): one worker, many readers.

A :class:`LogitsBackend` owns one worker thread that alone calls into the model. Requests wait in
its :class:`~.inbox.Inbox` (the same one the exllamav3 driver takes from); up to ``max_sessions``
decode at once, one step each in turn (the CPU reference keeps a KV cache per request; v1 and v2 have
one cache, so one session). Steps go to each request's ``emit``; a reader that stops reading never
holds the model.

Sampling is transformers' logits processors on the CPU in fp32 (a [1, vocab] row is cheap to move
and keeps results identical across devices), so settings mean the same on every such backend. The
grammar's mask is applied after the repetition penalty, before the warpers' draw, so a forbidden
token can never be sampled; the sampler then feeds the grammar the token it chose (it owns the
grammar state). A reasoning request's control sees every token; while it thinks there is no mask,
and the tokens it forces (the end of the thinking block, once the budget is spent) are written as
they are.
"""

from __future__ import annotations

import gc
import logging
import random
import threading
from abc import abstractmethod
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from .base import Backend, BackendRequest, RawLogprob, StepFinish, TokenStep, fail_all
from .inbox import Inbox, WorkerTask

if TYPE_CHECKING:
    import torch

    from ..contract.settings import GenerationSettings

logger = logging.getLogger(__name__)

GREEDY_BELOW = 1e-5
"""A temperature below this is greedy decoding, on every backend (vLLM's bound too): dividing logits by a
temperature of 1e-40 makes them infinite, and their softmax NaN."""


def is_greedy(settings: GenerationSettings) -> bool:
    """Whether ``settings`` decode greedily: temperature 0 (or below :data:`GREEDY_BELOW`), or ``top_k=1``."""
    return settings.greedy or settings.temperature < GREEDY_BELOW


class _NoRepeatInOutput:
    """transformers' n-gram ban, over the generated tokens only (the prompt may repeat itself freely)."""

    def __init__(self, proc: Any, prompt_len: int) -> None:
        self.proc, self.prompt_len = proc, prompt_len

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        return self.proc(input_ids[:, self.prompt_len :], scores)


class _LogitBias:
    """OpenAI's ``logit_bias``: fixed amounts added to some tokens' logits (ids past the vocabulary are ignored)."""

    def __init__(self, bias: dict[int, float]) -> None:
        self.bias = bias
        self._made: tuple[Any, Any] | None = None

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        if self._made is None:  # once per request, not per step: the vocabulary does not change
            import torch

            kept = [(t, b) for t, b in self.bias.items() if t < scores.shape[-1]]
            ids = torch.tensor([t for t, _ in kept], dtype=torch.long)
            self._made = ids, torch.tensor([b for _, b in kept], dtype=scores.dtype)
        ids, values = self._made
        scores[:, ids] += values
        return scores


class _PresenceFrequency:
    """OpenAI's presence and frequency penalties, over the generated tokens only (the prompt is not counted)."""

    def __init__(self, presence: float, frequency: float, prompt_len: int) -> None:
        self.presence, self.frequency, self.prompt_len = presence, frequency, prompt_len

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        out = input_ids[:, self.prompt_len :]
        if out.shape[-1] == 0:
            return scores
        counts = torch.zeros_like(scores)
        counts.scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def logits_processors(settings: GenerationSettings, prompt_len: int = 0) -> Any:
    """Transformers' LogitsProcessorList for these settings (bias and penalties first, then the warpers)."""
    from transformers import (
        LogitsProcessorList,
        MinPLogitsWarper,
        NoRepeatNGramLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
        TypicalLogitsWarper,
    )

    procs = LogitsProcessorList()
    if settings.logit_bias:
        procs.append(_LogitBias(settings.logit_bias))
    if settings.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(settings.repetition_penalty))
    if settings.presence_penalty or settings.frequency_penalty:
        procs.append(_PresenceFrequency(settings.presence_penalty, settings.frequency_penalty, prompt_len))
    if settings.no_repeat_ngram_size:
        procs.append(_NoRepeatInOutput(NoRepeatNGramLogitsProcessor(settings.no_repeat_ngram_size), prompt_len))
    if is_greedy(settings):
        return procs
    if settings.temperature != 1.0:
        procs.append(TemperatureLogitsWarper(settings.temperature))
    if settings.top_k > 0:
        procs.append(TopKLogitsWarper(settings.top_k))
    if settings.top_p < 1.0:
        procs.append(TopPLogitsWarper(settings.top_p))
    if settings.min_p > 0.0:
        procs.append(MinPLogitsWarper(settings.min_p))
    if settings.typical < 1.0:
        procs.append(TypicalLogitsWarper(settings.typical))
    return procs


class Sampler:
    """Picks each next token for one request: penalties, grammar mask, warpers, seeded draw, logprobs."""

    def __init__(self, request: BackendRequest) -> None:
        import torch

        s = self.settings = request.settings
        self.constraint = request.constraint
        self.steering = request.steering
        self.stop_ids = sorted(t for t in request.stop_token_ids if t < 1 << 31)
        self.procs = logits_processors(s, len(request.prompt_ids))
        self.rng = None
        self.greedy = is_greedy(s)
        if not self.greedy:
            self.rng = torch.Generator(device="cpu")
            self.rng.manual_seed(s.seed if s.seed is not None else random.getrandbits(63))
        self.seen = torch.tensor([request.prompt_ids], dtype=torch.long)
        self._queue: deque[int] = deque()

    def sample(self, logits: torch.Tensor) -> tuple[int, RawLogprob | None]:
        """The next token from last-position ``logits`` [1, vocab], and its logprobs when asked for."""
        import torch

        s, steer = self.settings, self.steering
        constraint = self.constraint if steer is None or steer.constrained else None
        raw = logits.float().cpu()
        forced = self._forced()
        if forced is not None:
            token = forced
        else:
            scores = self.procs(self.seen, raw.clone()) if len(self.procs) else raw.clone()
            if steer is not None and self.constraint is not None and not steer.constrained:
                scores[0, self.stop_ids] = float("-inf")  # a constrained answer is owed: no ending while thinking
            if constraint is not None:
                constraint.mask_logits(scores)
                if (s.no_repeat_ngram_size or s.repetition_penalty != 1.0) and torch.isinf(scores).all():
                    # the penalties banned every token the grammar allows: draw from the model's own logits
                    scores = raw.clone()
                    constraint.mask_logits(scores)
            if self.greedy:
                token = int(torch.argmax(scores, dim=-1)[0])
            else:
                probs = torch.softmax(scores, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=self.rng)[0, 0])
            if constraint is not None:
                constraint.accept(token)
        if steer is not None:
            steer.observe((token,))
        if len(self.procs):
            self.seen = torch.cat([self.seen, torch.tensor([[token]])], dim=1)
        return token, (raw_logprob(raw, token, s.logprobs) if s.logprobs is not None else None)

    def _forced(self) -> int | None:
        """The next token a reasoning request's control writes itself, if any."""
        if self.steering is None:
            return None
        if not self._queue:
            self._queue.extend(self.steering.forced())
        return self._queue.popleft() if self._queue else None


def raw_logprob(raw: torch.Tensor, token: int, k: int) -> RawLogprob:
    """Log-probability of ``token`` and the top ``k`` under the model's own distribution."""
    import torch

    lp = torch.log_softmax(raw.float(), dim=-1)[0]
    top: tuple[tuple[int, float], ...] = ()
    if k:
        vals, idx = torch.topk(lp, k)
        top = tuple((int(i), float(v)) for i, v in zip(idx, vals))
    return RawLogprob(token, float(lp[token]), top)


class PromptScore:
    """Each prompt token's logprob given the ones before it, with the top ``k``, gathered as the prefill goes.

    The prefill hands over its logits a chunk of positions at a time (:meth:`add`); each chunk is reduced to the
    chosen and top-``k`` logprobs ``rows`` positions at a time and let go, so a long prompt never holds its
    length x vocabulary logits at once (4000 ids x 49 152 float32: 0.8 GB; 32 768 x 152 064: 20 GB). The first
    token, which nothing precedes, gets 0.0 and no alternatives.
    """

    def __init__(self, ids: Sequence[int], k: int, rows: int = 256) -> None:
        self.ids, self.k, self.rows = list(ids), k, rows
        self.out: list[RawLogprob] = [RawLogprob(int(ids[0]), 0.0)] if ids else []

    def add(self, logits: torch.Tensor, start: int) -> None:
        """The logits [n, vocab] of positions ``start`` .. ``start + n - 1`` (each predicts the token after it)."""
        import torch

        ids, k = self.ids, self.k
        last = min(start + logits.shape[0], len(ids) - 1)  # the last position predicts nothing of the prompt
        for at in range(start, last, self.rows):
            n = min(self.rows, last - at)
            lp = torch.log_softmax(logits[at - start : at - start + n].float(), dim=-1)
            nxt = torch.tensor(ids[at + 1 : at + 1 + n], dtype=torch.long, device=lp.device)
            chosen = lp[torch.arange(n, device=lp.device), nxt].tolist()
            tops: list[tuple[tuple[int, float], ...]] = [()] * n
            if k:
                top_v, top_i = torch.topk(lp, k, dim=-1)
                tops = [tuple(zip(i, v)) for i, v in zip(top_i.tolist(), top_v.tolist())]
            for j in range(n):
                self.out.append(RawLogprob(ids[at + 1 + j], float(chosen[j]), tops[j]))

    def result(self) -> tuple[RawLogprob, ...]:
        """Every prompt token's logprob, in order."""
        return tuple(self.out)


def score_prompt(logits: torch.Tensor, ids: Sequence[int], k: int, rows: int = 256) -> tuple[RawLogprob, ...]:
    """Each prompt token's logprob under the logits of the position before it ([len(ids), vocab]), top ``k`` too."""
    score = PromptScore(ids, k, rows)
    score.add(logits, 0)
    return score.result()


class LogitsSession(Protocol):
    """One request's state on the model: ``prefill(prompt_ids)`` then ``step(token)``, each -> logits [1, vocab].

    A backend that takes images is handed their embeddings' source (:meth:`Backend.encode_media`) at prefill.
    """

    def prefill(self, ids: list[int], embeddings: Any = None) -> torch.Tensor: ...

    def step(self, token: int) -> torch.Tensor: ...

    # optional, for a backend that scores prompts (``prompt_logprobs``; others list it as unsupported):
    # prefill_scored(ids, embeddings, k) -> (last logits [1, vocab], score_prompt(...) of the ids)

    def close(self) -> None: ...


class _Decode:
    """One request being decoded by the worker."""

    def __init__(self, backend: LogitsBackend, request: BackendRequest) -> None:
        self.backend, self.req = backend, request
        self.session: LogitsSession | None = None
        self.sampler: Sampler | None = None
        self.n = 0
        self.token = -1

    def advance(self) -> bool:
        """Run one step and hand it on; False once the request has ended."""
        req = self.req
        if req.cancel.is_set():
            return self.end("cancelled")
        scored: tuple[RawLogprob, ...] | None = None
        try:
            if self.session is None:
                self.sampler = Sampler(req)
                self.session = self.backend.open_session()
                k = req.settings.prompt_logprobs
                if k is not None:
                    logits, scored = self.session.prefill_scored(req.prompt_ids, req.embeddings, k)  # type: ignore[attr-defined]
                else:
                    logits = self.session.prefill(req.prompt_ids, req.embeddings)
            else:
                logits = self.session.step(self.token)
            assert self.sampler is not None
            self.token, lp = self.sampler.sample(logits)
        except Exception as e:  # noqa: BLE001 - fail this request, keep serving the others
            logger.exception("%s: a decoding step failed", self.backend.name)
            return self.end("error", e)
        self.n += 1
        finish: StepFinish | None = None
        if self.token in req.stop_token_ids:
            finish = "stop_token"
        elif self.n >= req.max_new_tokens:
            finish = "length"
        if finish is not None:
            self._close_session()
        req.emit(TokenStep((self.token,), (lp,) if lp is not None else None, finish, prompt_logprobs=scored))
        return finish is None

    def end(self, finish: StepFinish, error: BaseException | None = None) -> bool:
        self._close_session()
        self.req.emit(TokenStep(finish=finish, error=error))
        return False

    def _close_session(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            try:
                session.close()
            except Exception:  # noqa: BLE001 - best effort
                logger.debug("closing a session failed", exc_info=True)


class LogitsBackend(Backend):
    """Shared worker for logits-level backends: subclasses load the model and open sessions."""

    max_sessions: ClassVar[int] = 1
    """Requests decoded at once (in turn, a step each)."""

    def _start_worker(self) -> None:
        """Start the worker; call at the end of a successful ``__init__``."""
        self.inbox = Inbox(window=0.0)
        self._worker = threading.Thread(target=self._work, name=f"exllama-{self.name}-worker", daemon=True)
        self._worker.start()

    @abstractmethod
    def open_session(self) -> LogitsSession:
        """A fresh per-request state (cache) on the loaded model."""

    def library_objects(self) -> dict[str, Any]:
        """``open_session``: a fresh session, for tests that drive the model step by step (diagnostics)."""
        return {"open_session": self.open_session}

    @abstractmethod
    def _free(self) -> None:
        """Free weights and cache (called once the worker has stopped)."""

    def submit(self, requests: Sequence[BackendRequest]) -> None:
        if not self.inbox.put(requests):
            fail_all(requests)

    def _work(self) -> None:
        import torch

        active: list[_Decode] = []
        waiting: deque[BackendRequest] = deque()
        try:
            with torch.inference_mode():
                while True:
                    incoming = self.inbox.take(idle=not active and not waiting)
                    if incoming is None:
                        break
                    for item in incoming:
                        if isinstance(item, WorkerTask):  # work handed in beside requests runs now, between steps
                            item.run()
                        else:
                            waiting.append(item)
                    while waiting and len(active) < self.max_sessions:
                        active.append(_Decode(self, waiting.popleft()))
                    active = [d for d in active if d.advance()]
        except BaseException as e:  # noqa: BLE001 - never leave a reader waiting
            logger.exception("%s worker stopped", self.name)
            for d in active:
                d.end("error", e)
            active = []
        finally:
            for d in active:
                d.end("cancelled")
            fail_all([*waiting, *self.inbox.close()])

    def close(self) -> None:
        worker = getattr(self, "_worker", None)
        if worker is not None:
            fail_all(self.inbox.close())
            if worker is not threading.current_thread():
                worker.join()  # the step in flight finishes first: nothing runs on freed weights
        with _free_lock:
            if getattr(self, "_freed", False):
                return
            self._freed = True
        self._free()


_free_lock = threading.Lock()


def release(*steps: tuple[Any, str]) -> None:
    """Call ``obj.method()`` for each (obj, method) best-effort, then collect and return cached CUDA memory."""
    for obj, method in steps:
        if obj is None:
            continue
        try:
            getattr(obj, method)()
        except Exception:  # noqa: BLE001 - best effort on the way out
            logger.debug("%s.%s() failed", type(obj).__name__, method, exc_info=True)
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
