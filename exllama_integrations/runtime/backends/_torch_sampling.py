"""Per-step sampling on a logits tensor, for backends that hand us logits (CPU reference, ExLlama v1).

One implementation, transformers' logits processors, so that settings mean the same on each.
"""

from __future__ import annotations

import gc
import logging
import random
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from .base import BackendRequest, TokenLogprob, TokenStep

if TYPE_CHECKING:
    import torch

    from ..settings import GenerationSettings

logger = logging.getLogger(__name__)


class _NoRepeatInOutput:
    """transformers' n-gram ban, over the generated tokens only (the prompt may repeat itself freely)."""

    def __init__(self, proc: Any, prompt_len: int) -> None:
        self.proc, self.prompt_len = proc, prompt_len

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        return self.proc(input_ids[:, self.prompt_len :], scores)


def logits_processors(settings: GenerationSettings, prompt_len: int = 0) -> Any:
    """Transformers' LogitsProcessorList for these settings (penalty first, then the warpers)."""
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
    if settings.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(settings.repetition_penalty))
    if settings.no_repeat_ngram_size:
        procs.append(_NoRepeatInOutput(NoRepeatNGramLogitsProcessor(settings.no_repeat_ngram_size), prompt_len))
    if settings.greedy:
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


def sample_loop(
    request: BackendRequest,
    prefill: Callable[[list[int]], torch.Tensor],
    step: Callable[[int], torch.Tensor],
) -> Iterator[TokenStep]:
    """Decode token by token: ``prefill(prompt_ids)`` and ``step(token)`` return last-position logits [1, vocab].

    Sampling runs on the CPU in fp32 (a [1, vocab] row is cheap to move and keeps results identical
    across devices); the constraint's mask is applied after the repetition penalty, before the warpers'
    draw, so a constrained token can never be sampled.
    """
    import torch

    s = request.settings
    procs = logits_processors(s, len(request.prompt_ids))
    rng = None
    if not s.greedy:
        rng = torch.Generator(device="cpu")
        rng.manual_seed(s.seed if s.seed is not None else random.getrandbits(63))
    constraint = request.constraint
    seen = torch.tensor([request.prompt_ids], dtype=torch.long)
    token = -1
    for i in range(request.max_new_tokens):
        if request.cancel.is_set():
            return
        logits = prefill(request.prompt_ids) if i == 0 else step(token)
        raw = logits.float().cpu()
        scores = procs(seen, raw.clone()) if len(procs) else raw.clone()
        if constraint is not None:
            constraint.mask_logits(scores)
            if (s.no_repeat_ngram_size or s.repetition_penalty != 1.0) and torch.isinf(scores).all():
                # the penalties banned every token the grammar allows: draw from the model's own logits
                scores = raw.clone()
                constraint.mask_logits(scores)
        if s.greedy:
            token = int(torch.argmax(scores, dim=-1)[0])
        else:
            probs = torch.softmax(scores, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=rng)[0, 0])
        if constraint is not None:
            constraint.accept(token)
        lp = [step_logprobs(raw, token, s.logprobs)] if s.logprobs is not None else None
        yield TokenStep([token], lp)
        if len(procs):
            seen = torch.cat([seen, torch.tensor([[token]])], dim=1)


def step_logprobs(raw: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """Log-probability of ``token`` and the top ``k`` under the model's distribution."""
    import torch

    lp = torch.log_softmax(raw.float(), dim=-1)[0]
    top: tuple[tuple[int, float], ...] = ()
    if k:
        vals, idx = torch.topk(lp, k)
        top = tuple((int(i), float(v)) for i, v in zip(idx, vals))
    return TokenLogprob(token, float(lp[token]), top)


def cached_forward_loop(
    request: BackendRequest, model: Any, cache: Any, lock: threading.Lock, **forward_kwargs: Any
) -> Iterator[TokenStep]:
    """Decode on an ExLlama v1/v2 model: ``model.forward(ids, cache, last_id_only=True)`` per step."""
    import torch

    def forward(ids: list[int], reset: bool) -> torch.Tensor:
        if reset:
            cache.current_seq_len = 0
        x = torch.tensor([ids], dtype=torch.long)
        return model.forward(x, cache, last_id_only=True, **forward_kwargs)[:, -1, :]

    with lock, torch.inference_mode():
        yield from sample_loop(request, lambda ids: forward(ids, True), lambda token: forward([token], False))


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
