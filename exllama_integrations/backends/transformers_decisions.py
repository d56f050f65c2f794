"""Label scoring on the transformers backend (decision questions): the prefix read once, the labels in one forward.

A request (a job: a prefix, then each question's own tokens, then each label's) is packed as a tree: the prefix,
every question after it and every label's tokens but its last after its question, with a 4D attention mask that
lets a question's tokens see the prefix and themselves only, and a label's tokens the prefix, their question and
that label's earlier tokens only, each at the position it has in the reply. One forward of the tree computes the
prefix once and gives the logits after each question (every label's first token) and after each label token (the
rest); the LM head runs only at those positions. A request whose tree is longer than ``PREFILL_CHUNK`` tokens reads
its prefix into a KV cache first (chunked, as a prompt is), then its questions in groups of that size, each group on
a copy of the prefix's cache (a question larger than that alone, label by label: the mask grows as the square of a
forward's tokens). No label is read twice and nothing is re-tokenized.

What a request computes depends only on the request: the same request twice is bitwise the same, and so is a
request inside a burst of others (the worker runs one forward at a time, of this request's tokens only). A question
beside other questions of its request shares their forward, so it agrees with itself asked alone to rounding
(within 1e-6 on the demo model, tested), not bitwise.

Models the tree cannot be packed for (recurrent layers: Gated DeltaNet, Mamba; sliding-window layers; 3-D rope
positions; attention other than sdpa or eager) take the plain path: the prefix into a cache, each question on a copy
of it, then each label of more than one token on a copy of the question's.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from ..contract.decisions import LabelBranch, LabelLogprobs, LabelScoring

if TYPE_CHECKING:
    import torch

_Session = Any
"""The transformers backend's per-request session (its ``prefill``, ``_forward``, ``cache``, ``backend``): taken as
a value, so this module does not import the backend's (which imports this one)."""

PACKED_ATTENTION = ("sdpa", "eager")


def packable(session: _Session) -> bool:
    """Whether the tree of a question and its labels can be one forward on this model (see the module docstring)."""
    b = session.backend
    config = b.model.config
    kinds = set(getattr(config, "layer_types", None) or ("full_attention",))
    impl = getattr(config, "_attn_implementation", None)
    return kinds == {"full_attention"} and b._rope_holder is None and impl in PACKED_ATTENTION


def _tree(
    root: tuple[int, ...], branches: tuple[LabelBranch, ...], past: int
) -> tuple[list[int], list[int], Any, list[list[int]]]:
    """The packed tree: its tokens, their positions, what each may see ([tokens, past + tokens]) and its reads.

    The reads are, per branch, the rows whose logits score its labels: the question's last position (or the root's
    last; -1: the cached prefix's), then each label token's.
    """
    import torch

    tokens, positions = list(root), list(range(past, past + len(root)))
    owner: list[tuple[int, int]] = [(-1, -1)] * len(root)  # (branch, label): -1 the root, or the question's own
    reads: list[list[int]] = []
    for b, branch in enumerate(branches):
        at = past + len(root)
        tokens.extend(branch.suffix)
        positions.extend(range(at, at + len(branch.suffix)))
        owner.extend([(b, -1)] * len(branch.suffix))
        rows = [len(tokens) - 1 if branch.suffix else len(root) - 1 if root else -1]
        at += len(branch.suffix)
        for j, label in enumerate(branch.labels):
            rows.extend(range(len(tokens), len(tokens) + len(label) - 1))
            tokens.extend(label[:-1])
            positions.extend(range(at, at + len(label) - 1))
            owner.extend([(b, j)] * (len(label) - 1))
        reads.append(rows)
    n = len(tokens)
    of_branch = torch.tensor([o[0] for o in owner])
    of_label = torch.tensor([o[1] for o in owner])
    idx = torch.arange(n)
    same_branch = of_branch[None, :] == of_branch[:, None]
    own_label = (of_label[None, :] == -1) | (of_label[None, :] == of_label[:, None])
    see = (idx[None, :] <= idx[:, None]) & ((of_branch[None, :] == -1) | (same_branch & own_label))
    mask = torch.ones((n, past + n), dtype=torch.bool)
    mask[:, past:] = see
    return tokens, positions, mask, reads


def _packed(
    session: _Session, root: tuple[int, ...], branches: tuple[LabelBranch, ...], past: int, after: Any
) -> list[tuple[float, ...]]:
    """One forward over ``root`` and ``branches`` packed as a tree after ``past`` cached positions."""
    import torch

    b = session.backend
    tokens, positions, see, reads = _tree(root, branches, past)
    if b.model.config._attn_implementation == "sdpa":
        mask = see
    else:  # eager adds the mask to the scores
        mask = torch.zeros(see.shape, dtype=b.dtype).masked_fill(~see, torch.finfo(b.dtype).min)
    keep = sorted({r for rows in reads for r in rows if r >= 0})
    lp: Any = None
    if keep:
        out = b.model(
            input_ids=torch.tensor([tokens], dtype=torch.long, device=b.device),
            position_ids=torch.tensor([positions], device=b.device),
            attention_mask=mask[None, None].to(b.device),
            use_cache=True,
            # the head only where a label is scored (on a small model it is a fifth of the weights)
            logits_to_keep=torch.tensor(keep, device=b.device),
            **{b._cache_kw: session.cache},
        )
        lp = torch.log_softmax(out.logits[0].double(), dim=-1)
    row_of = {r: i for i, r in enumerate(keep)}
    out_scores = []
    for branch, rows in zip(branches, reads):
        first = lp[row_of[rows[0]]] if rows[0] >= 0 else torch.log_softmax(after[0].double(), dim=-1)
        scores, at = [], 1
        for label in branch.labels:
            total = float(first[label[0]])
            if len(label) > 1:
                picked = lp[[row_of[r] for r in rows[at : at + len(label) - 1]], list(label[1:])]
                total += float(picked.sum())
                at += len(label) - 1
            scores.append(total)
        out_scores.append(tuple(scores))
    return out_scores


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


def _size(branch: LabelBranch) -> int:
    """Tokens a branch adds to a packed forward."""
    return len(branch.suffix) + sum(len(lab) - 1 for lab in branch.labels)


def _groups(branches: tuple[LabelBranch, ...], room: int) -> list[tuple[LabelBranch, ...]]:
    """Consecutive branches packed while their tokens fit ``room`` (a larger one alone)."""
    groups: list[list[LabelBranch]] = [[]]
    used = 0
    for branch in branches:
        size = _size(branch)
        if groups[-1] and used + size > room:
            groups.append([])
            used = 0
        groups[-1].append(branch)
        used += size
    return [tuple(g) for g in groups]


def score_labels(session: _Session, job: LabelScoring, chunk: int) -> LabelLogprobs:
    """Each branch's labels' log-probabilities (see the module docstring); runs on the backend's worker.

    ``chunk``: the most tokens one forward packs (the backend's prefill chunk).
    """
    packed = packable(session)
    if packed and len(job.prefix) + sum(_size(b) for b in job.branches) <= chunk:
        return tuple(_packed(session, job.prefix, job.branches, 0, None))  # the whole request: one forward
    after_prefix = session.prefill(list(job.prefix))
    prefix_cache, prefix_rope = session.cache, session.rope_deltas
    scores: list[tuple[float, ...]] = []
    for group in _groups(job.branches, chunk) if packed else [(b,) for b in job.branches]:
        session.cache, session.rope_deltas = copy.deepcopy(prefix_cache), prefix_rope
        if packed and sum(_size(b) for b in group) <= chunk:
            scores.extend(_packed(session, (), group, len(job.prefix), after_prefix))
        else:  # a question whose labels alone are over a forward's size (the mask grows as its square): label by label
            scores.extend(_branch_plain(session, b, after_prefix) for b in group)
    return tuple(scores)


__all__ = ["packable", "score_labels"]
