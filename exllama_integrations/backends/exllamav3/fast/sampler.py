"""One pass that samples the next token of every job in a decode step (plain torch: GPU, or CPU in tests).

The rule (what it covers; anything else is sampled by exllamav3 as before, job by job, and said so):
covered are logit bias, repetition penalty (prompt and output, transformers' rule), presence and frequency
penalties (output only, OpenAI's rule), then greedy (argmax), or temperature, min-p, top-k, top-p and a
seeded draw, in exllamav3's ``ComboSampler`` order (temperature first; min-p, top-k, top-p each on what the
step before kept; the token that crosses top-p is kept). Not covered (see :func:`uncovered`): typical
sampling and no-repeat n-grams (exllamav3 refuses them anyway); grammar masks, forced tokens, logprobs and
drafted windows are the caller's to route around (:mod:`.decode`).

The draw is an exponential race (``argmax(p / q)``, ``q ~ Exp(1)``: the Gumbel-max trick in probability space,
exact sampling from ``p``) with counter-based noise: each token's ``q`` is a hash of (the job's seed, the job's
step, the token id). So a job's draws do not depend on which jobs share its batch or in what order, a seed gives
the same tokens on every run of the same logits, and no generator state lives anywhere: a per-job
``torch.Generator`` would cost one launch per job (torch draws a whole tensor from one generator).

Host syncs: none here. The per-row settings travel in one pinned tensor, copied without blocking; the caller
reads the tokens back (exllamav3's loop does so with one synchronize per step).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...logits import is_greedy

if TYPE_CHECKING:
    import torch

MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class RowSettings:
    """How one job samples (our ``GenerationSettings`` reduced to what the batched pass reads)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    greedy: bool = False
    seed: int = field(default_factory=lambda: random.getrandbits(32))

    @property
    def plain_greedy(self) -> bool:
        """Greedy without a bias or penalties: the token is the argmax of the model's logits."""
        return self.greedy and not self.logit_bias and not self.penalised

    @property
    def penalised(self) -> bool:
        """Whether the job's past tokens change its logits."""
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty or self.frequency_penalty)


def uncovered(settings: Any) -> str | None:
    """Why these generation settings are not sampled by the batched pass, or None when they are."""
    if getattr(settings, "typical", 1.0) < 1.0:
        return "typical sampling"
    if getattr(settings, "no_repeat_ngram_size", 0):
        return "no_repeat_ngram_size"
    return None


def row_settings(settings: Any) -> RowSettings:
    """Our ``GenerationSettings`` as a :class:`RowSettings` (a request without a seed gets a random one)."""
    seed = settings.seed if settings.seed is not None else random.getrandbits(32)
    return RowSettings(
        temperature=float(settings.temperature),
        top_k=int(settings.top_k),
        top_p=float(settings.top_p),
        min_p=float(settings.min_p),
        repetition_penalty=float(settings.repetition_penalty),
        presence_penalty=float(settings.presence_penalty),
        frequency_penalty=float(settings.frequency_penalty),
        logit_bias=tuple(sorted((int(t), float(b)) for t, b in dict(settings.logit_bias).items())),
        greedy=is_greedy(settings),
        seed=int(seed) & MASK32,
    )


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x`` in [0, 2**32), without int64 overflow (the constant split in halves)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (Wellons' lowbias32) on int64 tensors holding values in [0, 2**32)."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def exponential_noise(seeds: torch.Tensor, steps: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """``Exp(1)`` noise [B, N] for each row's (seed, step) at ``token_ids`` [B, N] (int64): counter-based."""
    import torch

    key = hash32((hash32(seeds) + steps * 0x9E3779B9) & MASK32)
    h = hash32(key[:, None] ^ hash32(token_ids + 0x632BE5AB))
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # (0, 1), 24 bits: exact in float32
    return -torch.log(u)


class BatchedSampler:
    """Samples one token for each row of a [B, V] logits tensor (see the module docstring)."""

    def __init__(self, vocab_limit: int | None = None) -> None:
        """``vocab_limit``: ids at and past it are never sampled (the tokenizer's real vocabulary)."""
        self.vocab_limit = vocab_limit

    @staticmethod
    def _upload(rows: list[RowSettings], steps: list[int], device: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' float settings [B, 7] and int settings [B, 3] (top_k, seed, step) on ``device``."""
        import torch

        pin = device.type == "cuda"
        f = torch.tensor(
            [
                (
                    1.0 if r.greedy else r.temperature,
                    r.top_p,
                    r.min_p,
                    r.repetition_penalty,
                    r.presence_penalty,
                    r.frequency_penalty,
                    float(r.greedy),
                )
                for r in rows
            ],
            dtype=torch.float32,
        )
        i = torch.tensor([(r.top_k, r.seed, s) for r, s in zip(rows, steps)], dtype=torch.int64)
        if pin:
            f, i = f.pin_memory(), i.pin_memory()
        return f.to(device, non_blocking=pin), i.to(device, non_blocking=pin)

    def sample(
        self,
        logits: torch.Tensor,
        rows: list[RowSettings],
        steps: list[int],
        past: list[torch.Tensor | None] | None = None,
        prompt_lens: list[int] | None = None,
    ) -> torch.Tensor:
        """The next token of each row, a [B] int64 tensor on ``logits``' device.

        ``steps``: each row's counter for its noise (the job's tokens so far). ``past``: each row's token ids so far,
        prompt first (1-D; needed only by penalised rows), ``prompt_lens``: where each row's output starts in it.
        """
        import torch

        n, vocab = logits.shape
        dev = logits.device
        if all(r.plain_greedy for r in rows):  # argmax alone: no copy, no upload
            return torch.argmax(logits[:, : min(vocab, self.vocab_limit or vocab)], dim=-1)
        x = logits.float().clone()
        if self.vocab_limit is not None and self.vocab_limit < vocab:
            x[:, self.vocab_limit :] = float("-inf")
        fs, ints = self._upload(rows, steps, dev)
        temperature, top_p, min_p, rep_p, presence, frequency, greedy = fs.unbind(1)
        top_k, seeds, counters = ints.unbind(1)
        bias = [(j, t, b) for j, r in enumerate(rows) for t, b in r.logit_bias if t < vocab]
        if bias:
            bi = torch.tensor([(j, t) for j, t, _ in bias], dtype=torch.int64).to(dev, non_blocking=True)
            bv = torch.tensor([b for _, _, b in bias], dtype=torch.float32).to(dev, non_blocking=True)
            x.index_put_((bi[:, 0], bi[:, 1]), bv, accumulate=True)
        if any(r.penalised for r in rows):
            x = self._penalise(x, rows, past, prompt_lens, rep_p, presence, frequency)
        best = torch.argmax(x, dim=-1)
        if all(r.greedy for r in rows):
            return best
        scaled = x / temperature[:, None]
        ordered, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        keep = probs >= (min_p[:, None] * probs[:, :1])
        ranks = torch.arange(vocab, device=dev)
        keep &= (top_k[:, None] <= 0) | (ranks[None, :] < top_k[:, None])
        kept = probs * keep
        kept = kept / kept.sum(dim=-1, keepdim=True)
        before = torch.cumsum(kept, dim=-1) - kept
        keep &= (top_p[:, None] >= 1.0) | (before < top_p[:, None]) | (ranks[None, :] == 0)
        weights = probs * keep
        race = weights / exponential_noise(seeds, counters, order)
        drawn = order.gather(1, torch.argmax(race, dim=-1, keepdim=True)).squeeze(1)
        return torch.where(greedy > 0, best, drawn)

    @staticmethod
    def _penalise(
        x: torch.Tensor,
        rows: list[RowSettings],
        past: list[torch.Tensor | None] | None,
        prompt_lens: list[int] | None,
        rep_p: torch.Tensor,
        presence: torch.Tensor,
        frequency: torch.Tensor,
    ) -> torch.Tensor:
        """Repetition penalty over each row's whole past; presence and frequency over its output only."""
        import torch

        if past is None or prompt_lens is None:
            raise ValueError("penalised rows need their past token ids and prompt lengths")
        dev = x.device
        seqs = [p.reshape(-1) if r.penalised and p is not None else None for p, r in zip(past, rows)]
        lens = [int(s.numel()) if s is not None else 0 for s in seqs]
        total = sum(lens)
        if not total:
            return x
        flat = torch.cat([s.to(dev, non_blocking=True) for s in seqs if s is not None])
        lens_t = torch.tensor(lens, dtype=torch.int64).to(dev, non_blocking=True)
        starts = torch.tensor([p if n else 0 for p, n in zip(prompt_lens, lens)], dtype=torch.int64)
        starts = starts.to(dev, non_blocking=True)
        row = torch.repeat_interleave(torch.arange(len(rows), device=dev), lens_t, output_size=total)
        first = torch.cumsum(lens_t, 0) - lens_t
        pos = torch.arange(total, device=dev) - first[row]
        seen = torch.zeros_like(x, dtype=torch.bool)
        seen[row, flat] = True
        pen = rep_p[:, None]
        x = torch.where(seen, torch.where(x < 0, x * pen, x / pen), x)
        out = (pos >= starts[row]).to(x.dtype)  # prompt positions add 0: no boolean indexing, which would sync
        counts = torch.zeros_like(x)
        counts.index_put_((row, flat), out, accumulate=True)
        return x - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(x.dtype)
