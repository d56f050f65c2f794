"""Label scoring on exllamav3 (decision questions), on the driver's thread, through the rerank's cache-free forward.

Each forward is one row in ``attn_mode="flash_attn_nc"`` (no cache: nothing the generator's pages hold is read or
written, and what runs beside it cannot change its result), as the yes/no reranker reads its logits
(:mod:`.pooling`). A branch's prompt (the job's prefix and the branch's suffix) is read once for the first token of
every label; a label of more than one token is read again as the prompt and its tokens but the last, the head kept
to those last positions (``last_tokens_only``). So the prefix is computed once per question and once more per
multi-token label here, not once per request as on the CPU backend, whose cache can be copied.

Unproven on a GPU: tests/gpu/test_gpu_decisions.py compares it with the transformers oracle (not yet run).
"""

from __future__ import annotations

from typing import Any

from ...contract.decisions import LabelLogprobs, LabelScoring


def _logprobs(model: Any, ids: list[int], last: int) -> Any:
    """Log-probabilities (float64) of the last ``last`` positions of one row, vocabulary cropped to the model's."""
    import torch

    params: dict[str, Any] = {"attn_mode": "flash_attn_nc", "last_tokens_only": last}
    logits = model.forward(torch.tensor([ids], dtype=torch.long), params)
    logits = logits[0, -last:, : model.config.vocab_size]
    return torch.log_softmax(logits.double(), dim=-1).cpu()


def score_labels_nc(model: Any, job: LabelScoring) -> LabelLogprobs:
    """Each branch's labels' log-probabilities (see the module docstring)."""
    out = []
    for branch in job.branches:
        prompt = [*job.prefix, *branch.suffix]
        first = _logprobs(model, prompt, 1)[0]
        scores = []
        for label in branch.labels:
            total = float(first[label[0]])
            if len(label) > 1:
                rest = _logprobs(model, prompt + list(label[:-1]), len(label) - 1)
                total += sum(float(rest[i, t]) for i, t in enumerate(label[1:]))
            scores.append(total)
        out.append(tuple(scores))
    return tuple(out)


__all__ = ["score_labels_nc"]
