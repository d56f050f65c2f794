"""Label scoring on the transformers backend (decision questions): the prefix once, then one forward per question.

The job's prefix is read once into a KV cache. Each question (a branch) is then one forward on a copy of that
cache over its own tokens followed by every label's tokens but its last, packed as a tree: a 4D attention mask
lets each label's tokens see the prefix, the question and that label's own earlier tokens only, at the positions
they would have in the reply. One forward gives the logits after the question (every label's first token) and
after each label token (the rest), so a question costs one forward however many labels it has; no label is read
again and nothing is re-tokenized.

What a question computes depends only on the prefix and the question itself (never on the request's other
questions or on what else the worker runs), so its answer is the same alone, beside others and in a burst.

Models the tree cannot be packed for (recurrent layers: Gated DeltaNet, Mamba; sliding-window layers; 3-D rope
positions; attention other than sdpa or eager) take the plain path: the question on a copy of the prefix's
cache, then each label of more than one token on a copy of the question's.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from ..contract.decisions import LabelBranch, LabelLogprobs, LabelScoring

if TYPE_CHECKING:
    import torch

    from .transformers import _Session

PACKED_ATTENTION = ("sdpa", "eager")


def packable(session: _Session) -> bool:
    """Whether the tree of a question and its labels can be one forward on this model (see the module docstring)."""
    b = session.backend
    config = b.model.config
    kinds = set(getattr(config, "layer_types", None) or ("full_attention",))
    impl = getattr(config, "_attn_implementation", None)
    return kinds == {"full_attention"} and b._rope_holder is None and impl in PACKED_ATTENTION


def _tree(branch: LabelBranch, past: int, dtype: Any, device: Any, boolean: bool) -> tuple[list[int], Any, Any]:
    """The branch's packed tokens, their positions and the mask [1, 1, tokens, past + tokens]."""
    import torch

    tokens = list(branch.suffix)
    n_suffix = len(tokens)
    positions = list(range(past, past + n_suffix))
    owner = [-1] * n_suffix  # -1: the question's own tokens; j: label j's
    for j, label in enumerate(branch.labels):
        tokens.extend(label[:-1])
        positions.extend(range(past + n_suffix, past + n_suffix + len(label) - 1))
        owner.extend([j] * (len(label) - 1))
    n = len(tokens)
    see = torch.zeros((n, past + n), dtype=torch.bool)
    see[:, :past] = True
    own = torch.tensor(owner)
    idx = torch.arange(n)
    causal = idx[None, :] <= idx[:, None]
    same = (own[None, :] == -1) | (own[None, :] == own[:, None])
    see[:, past:] = causal & same
    if boolean:
        mask = see
    else:
        mask = torch.zeros(see.shape, dtype=dtype).masked_fill(~see, torch.finfo(dtype).min)
    return tokens, torch.tensor([positions], device=device), mask[None, None].to(device)


def _branch_packed(session: _Session, branch: LabelBranch, past: int, after_prefix: torch.Tensor) -> tuple[float, ...]:
    import torch

    b = session.backend
    boolean = b.model.config._attn_implementation == "sdpa"
    tokens, positions, mask = _tree(branch, past, b.dtype, b.device, boolean)
    if not tokens:  # no question tokens and single-token labels: the prefix's logits answer it
        first = torch.log_softmax(after_prefix[0].double(), dim=-1)
        return tuple(float(first[label[0]]) for label in branch.labels)
    n_suffix = len(branch.suffix)
    # the head only where a label is scored: the question's last position and each label token's (the head is a
    # fifth of a small model: over every question token it would cost more than the rest of the forward)
    keep = ([n_suffix - 1] if n_suffix else []) + list(range(n_suffix, len(tokens)))
    x = torch.tensor([tokens], dtype=torch.long, device=b.device)
    out = b.model(
        input_ids=x,
        position_ids=positions,
        attention_mask=mask,
        use_cache=True,
        logits_to_keep=torch.tensor(keep, device=b.device),
        **{b._cache_kw: session.cache},
    )
    lp = torch.log_softmax(out.logits[0].double(), dim=-1)  # row r: position keep[r]
    first = lp[0] if n_suffix else torch.log_softmax(after_prefix[0].double(), dim=-1)
    scores, at = [], 1 if n_suffix else 0
    for label in branch.labels:
        total = float(first[label[0]])
        if len(label) > 1:
            rest = lp[at : at + len(label) - 1]
            total += float(rest[torch.arange(len(label) - 1), torch.tensor(label[1:])].sum())
            at += len(label) - 1
        scores.append(total)
    return tuple(scores)


def _branch_plain(session: _Session, branch: LabelBranch, after_prefix: torch.Tensor) -> tuple[float, ...]:
    import torch

    last = session.prefill(list(branch.suffix)) if branch.suffix else after_prefix
    first = torch.log_softmax(last[0].double(), dim=-1)
    branch_cache, branch_rope = session.cache, session.rope_deltas
    scores = []
    for label in branch.labels:
        total = float(first[label[0]])
        if len(label) > 1:
            session.cache, session.rope_deltas = copy.deepcopy(branch_cache), branch_rope
            rest = torch.log_softmax(session._forward(list(label[:-1]), every=True).double(), dim=-1)
            total += sum(float(rest[i, t]) for i, t in enumerate(label[1:]))
        scores.append(total)
    return tuple(scores)


def score_labels(session: _Session, job: LabelScoring) -> LabelLogprobs:
    """Each branch's labels' log-probabilities (see the module docstring); runs on the backend's worker."""
    after_prefix = session.prefill(list(job.prefix))
    prefix_cache, prefix_rope = session.cache, session.rope_deltas
    packed = packable(session)
    out = []
    for branch in job.branches:
        session.cache, session.rope_deltas = copy.deepcopy(prefix_cache), prefix_rope
        if packed:
            out.append(_branch_packed(session, branch, len(job.prefix), after_prefix))
        else:
            out.append(_branch_plain(session, branch, after_prefix))
    return tuple(out)


__all__ = ["packable", "score_labels"]
