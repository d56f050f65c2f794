"""Our requests as exllamav3 Jobs, and exllamav3's results as our token steps.

A request's settings become a ``ComboSampler`` and the Job's arguments; its grammar matcher (the one
owner of the grammar state, see :class:`MatcherFilter`) becomes the Job's filter, waiting for the end of
the thinking block when the model reasons; ``iterate()`` results become :class:`TokenStep` values with
log-probabilities when they were asked for, and a finished job's drafted tokens are counted (:class:`DraftCounts`).
"""

from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING, Any

from ..base import BackendRequest, RawLogprob, StepFinish, TokenStep
from ..logits import is_greedy

if TYPE_CHECKING:
    from ...model.grammar import ConstraintMatcher


def sampler_for(settings: Any, prompt_len: int = 0) -> Any:
    """An exllamav3 sampler equivalent to our settings.

    exllamav3's ComboSampler (logit bias, repetition penalty, temperature, min_p, top_k, top_p: its own steps, in
    the order our logits processors apply them); with presence or frequency penalties, the same steps around
    :func:`output_penalties` (exllamav3's own penalty step counts the prompt too; OpenAI's counts only the output).
    """
    from .upstream import ComboSampler

    if not (settings.presence_penalty or settings.frequency_penalty):
        return ComboSampler(
            rep_p=settings.repetition_penalty,
            temperature=0.0 if is_greedy(settings) else settings.temperature,
            min_p=settings.min_p,
            top_k=settings.top_k,
            top_p=settings.top_p,
            logit_bias=dict(settings.logit_bias) or None,
        )
    from . import upstream as c

    steps = [
        c.SS_LogitBias(dict(settings.logit_bias)),
        c.SS_RepP(settings.repetition_penalty),
        output_penalties(settings.presence_penalty, settings.frequency_penalty, prompt_len),
    ]
    if is_greedy(settings):
        steps.append(c.SS_Argmax())
    else:
        steps += [
            c.SS_Temperature(settings.temperature),
            c.SS_MinP(settings.min_p),
            c.SS_TopK(settings.top_k),
            c.SS_TopP(settings.top_p),
            c.SS_Sample(),
        ]
    return c.CustomSampler(steps)


def output_penalties(presence: float, frequency: float, prompt_len: int) -> Any:
    """OpenAI's presence and frequency penalties as an exllamav3 sampler step, over the generated tokens only."""
    import torch

    from .upstream import SS, SS_Base

    class OutputPenalties(SS_Base):  # type: ignore[misc]
        def run(self, state: Any) -> None:
            if state.state == SS.INIT:
                state.logits = state.in_logits.to(torch.float, copy=True)
            out = state.past_ids[:, prompt_len:]
            if out.shape[-1]:
                out = out.to(state.logits.device)
                counts = torch.zeros_like(state.logits)
                counts.scatter_add_(1, out, torch.ones_like(out, dtype=counts.dtype))
                state.logits -= frequency * counts + presence * (counts > 0).to(counts.dtype)
            state.state = SS.LOGITS

        def reqs_past_ids(self) -> bool:
            return True

    return OutputPenalties()


def matcher_filter(tokenizer: Any, matcher: ConstraintMatcher, trigger_token: int | None = None) -> Any:
    """Our grammar matcher as an exllamav3 filter: exllamav3 masks and feeds it, and we read it when the job ends.

    One matcher per generation, fed only here (not again by the runtime), so the grammar state has one owner.
    ``trigger_token``: the filter waits for that token (the end of a thinking block) before it constrains.
    """
    from .upstream import Filter

    class MatcherFilter(Filter):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(tokenizer, trigger_token, None, eos_after_completed=True)

        def reset(self) -> None:
            matcher.reset()

        def accept_token(self, token: int) -> None:
            matcher.accept(token)

        def get_next_logit_mask(self) -> Any:
            return matcher.packed_mask()

        def is_completed(self) -> bool:
            return matcher.is_stopped()

    return MatcherFilter()


def thinking_filter(tokenizer: Any, request: BackendRequest, watch: Any) -> Any:
    """A filter that forbids the stop tokens while a constrained request thinks (its answer is owed).

    ``watch`` is a reasoning control of its own (the request's is advanced by the driver after each step, this
    one by exllamav3 as it samples); the filter completes, and steps aside, when the thinking block ends.
    """
    import torch

    from .upstream import Filter

    class ThinkingFilter(Filter):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(tokenizer, None, None, eos_after_completed=False)
            self._mask: Any = None

        def attach(self, job: Any) -> None:
            super().attach(job)
            words = self.vocab_size // 32 + 1
            mask = torch.full((1, words), -1, dtype=torch.int32)
            bits = mask.view(-1).numpy().view("uint32")
            for t in request.stop_token_ids:
                if t < words * 32:
                    bits[t >> 5] &= ~(1 << (t & 31)) & 0xFFFFFFFF
            self._mask = mask

        def reset(self) -> None:
            pass

        def accept_token(self, token: int) -> None:
            watch.observe((token,))

        def get_next_logit_mask(self) -> Any:
            return self._mask

        def is_completed(self) -> bool:
            return bool(watch.constrained)

        def use_background_worker(self) -> bool:
            return False

    return ThinkingFilter()


def job_for(request: BackendRequest, tokenizer: Any, embeddings: list[Any] | None = None) -> tuple[Any, bool]:
    """The Job for a request, and whether its grammar filter is still to be attached (after the thinking block).

    With reasoning, a grammar waits for the end delimiter: exllamav3's trigger token when the delimiter is one
    token, else it is attached by the driver once the request's reasoning control says the answer began.
    """
    import torch

    from .upstream import Job

    s = request.settings
    filters: list[Any] = []
    deferred = False
    if request.constraint is not None:
        steer = request.steering
        if steer is None or steer.constrained:
            filters = [matcher_filter(tokenizer, request.constraint)]
        else:
            filters = [thinking_filter(tokenizer, request, steer.twin())]
            if len(steer.end_ids) == 1:
                filters.append(matcher_filter(tokenizer, request.constraint, trigger_token=steer.end_ids[0]))
            else:
                deferred = True
    job = Job(
        input_ids=torch.tensor([request.prompt_ids], dtype=torch.long),
        max_new_tokens=request.max_new_tokens,
        sampler=sampler_for(s, len(request.prompt_ids)),
        seed=s.seed,
        stop_conditions=sorted(request.stop_token_ids),
        return_top_tokens=s.logprobs or 0,
        return_probs=s.logprobs is not None,
        filters=filters,
        decode_special_tokens=True,
        embeddings=embeddings or None,
    )
    return job, deferred


def tokens_of(r: dict[str, Any], k: int | None) -> tuple[list[int], tuple[RawLogprob, ...] | None]:
    """Token ids of a result (or its ``held`` part), with logprobs when they were asked for."""
    ids = r.get("token_ids")
    tokens = [int(t) for t in ids.flatten().tolist()] if ids is not None else []
    if k is None or r.get("token_probs") is None or not tokens:
        return tokens, None
    probs = r["token_probs"].flatten().tolist()
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(tokens)
    if k and r.get("top_k_tokens") is not None:
        tt = r["top_k_tokens"].reshape(len(tokens), -1).tolist()
        tp = r["top_k_probs"].reshape(len(tokens), -1).tolist()
        tops = [tuple((int(a), math.log(max(b, 1e-30))) for a, b in zip(ts, ps))[:k] for ts, ps in zip(tt, tp)]
    return tokens, tuple(RawLogprob(t, math.log(max(p, 1e-30)), top) for t, p, top in zip(tokens, probs, tops))


class LiveJob:
    """A job the driver runs, with the tokens it holds back for its reader (see ``stream_interval``)."""

    __slots__ = ("deferred", "job", "lps", "req", "sent", "steps", "tokens")

    def __init__(self, job: Any, req: BackendRequest, deferred: bool = False) -> None:
        self.job, self.req, self.deferred = job, req, deferred
        self.tokens: list[int] = []
        self.lps: list[Any] | None = None
        self.steps = 0
        self.sent = False

    def hold(self, tokens: list[int], lps: tuple[Any, ...] | None, step: bool = True) -> None:
        self.tokens += tokens
        if lps is not None:
            self.lps = [*(self.lps or ()), *lps]
        self.steps += step

    def take(self, finish: Any = None, cached: int | None = None, drafted: tuple[int, int] | None = None) -> TokenStep:
        """The tokens held so far as one step.

        The first step says how much of the prompt came from the cache; the last (``drafted``) how many drafted
        tokens the target accepted and rejected.
        """
        if cached is None and not self.sent:
            cached = cached_of(self.job)
        lps = tuple(self.lps) if self.lps is not None else None
        out = TokenStep(tuple(self.tokens), lps, finish, cached=cached, drafted=drafted)
        self.tokens, self.lps, self.steps, self.sent = [], None, 0, True
        return out


def cached_of(job: Any) -> int | None:
    """Prompt tokens ``job`` reused from the prefix cache, as its last result will say (None: not a job that says).

    exllamav3 1.6.5 matches a job's cached pages (and the best partial page) when it allocates them, before the first
    token, and reports ``(cached_pages * PAGE_SIZE + cached_tokens) // len(sequences)`` in the last result
    (``rq_cached`` for a job requeued mid-reply); reading it at the first token lets a reply's opening (the
    Messages API's ``message_start``) split its input tokens as its end does.
    """
    from .fast.requirements import PAGE_SIZE

    rq = getattr(job, "rq_cached", None)
    if isinstance(rq, tuple) and len(rq) == 2 and isinstance(rq[1], int):
        return rq[1]
    pages, tokens, seqs = (getattr(job, k, None) for k in ("cached_pages", "cached_tokens", "sequences"))
    if not isinstance(pages, int) or not isinstance(tokens, int) or not isinstance(seqs, list) or not seqs:
        return None
    return (pages * PAGE_SIZE + tokens) // len(seqs)


def finish_of(r: dict[str, Any]) -> StepFinish:
    """Our name for why exllamav3 ended a job (its ``eos_reason``)."""
    reason = r.get("eos_reason")
    if reason == "stop_token":
        return "stop_token"
    return "length" if reason == "max_new_tokens" else "end"


def drafted_of(r: dict[str, Any]) -> tuple[int, int] | None:
    """A finished job's drafted tokens the target accepted and rejected, from its last result (None: not drafting)."""
    accepted, rejected = r.get("accepted_draft_tokens"), r.get("rejected_draft_tokens")
    return (accepted, rejected) if isinstance(accepted, int) and isinstance(rejected, int) else None


class DraftCounts:
    """Drafted tokens the target accepted and rejected, over every job that finished (speculative decoding).

    exllamav3 reports a job's ``accepted_draft_tokens`` and ``rejected_draft_tokens`` in its last result (every
    drafted position is one or the other); the driver adds them here as jobs end, and :meth:`report` reads them.
    """

    def __init__(self, mode: str, num_draft_tokens: int) -> None:
        self.mode, self.num_draft_tokens = mode, num_draft_tokens
        self.jobs = self.accepted = self.rejected = 0
        self._lock = threading.Lock()

    def add(self, r: dict[str, Any]) -> tuple[int, int] | None:
        """Count a finished job's result; its (accepted, rejected) drafted tokens (one without draft counts: None)."""
        drafted = drafted_of(r)
        if drafted is not None:
            with self._lock:
                self.jobs += 1
                self.accepted += drafted[0]
                self.rejected += drafted[1]
        return drafted

    def report(self) -> dict[str, Any]:
        """The drafter, its window, and the counts so far: ``acceptance`` is accepted / drafted (None before any)."""
        with self._lock:
            drafted = self.accepted + self.rejected
            return {
                "mode": self.mode,
                "num_draft_tokens": self.num_draft_tokens,
                "jobs": self.jobs,
                "accepted_draft_tokens": self.accepted,
                "rejected_draft_tokens": self.rejected,
                "acceptance": round(self.accepted / drafted, 4) if drafted else None,
            }
