"""Label scoring on exllamav3 (decision questions), on the driver's thread between steps: the prefix once per request.

The paged path (:func:`score_labels_paged`): the job borrows pages of the generator's cache that no job references
(``PageTable.allocate_pages`` with no hashes: fresh pages, as a new job's own; evicting prompt-cache pages as a job
would), and gives them back when done. Into them:

1. the prefix, one page a forward (``attn_mode="flash_attn"``, the head kept to the last position), read once for
   every question of the request;
2. each question's own tokens after it, one forward (the logits of its last position score every label's first
   token), written after the prefix and overwritten by the next question's;
3. the rest of each label, as rows of one forward (``LABEL_ROWS`` labels a forward, in the question's order): each
   row's table is the question's pages and a page of its own, onto which the question's partial last page is copied
   first (``Cache.copy_page``), so rows never write where another reads.

The pages' K/V is overwritten, so no page keeps its old prompt-cache identity (``can_revert`` is cleared: a page
given back becomes a fresh unreferenced page, never a cached prefix). Batch invariance follows the deterministic
path's rules (:mod:`.fast.deterministic`): every forward holds only this question's rows, its prefix is chunked by
pages from position 0, and each table's width is the one exllamav3 gives a job alone at that position
(:func:`~.fast.deterministic.row_width`), so a question's numbers depend on its own tokens, never on the other
questions of its request or on what else the generator runs. Where the cache has no room for the job now, the
request is refused typed (503, retry) rather than answered on another path with other rounding.

The cache-free path (:func:`score_labels_nc`, ``attn_mode="flash_attn_nc"``, as the yes/no reranker reads its logits)
serves models with recurrent layers (their state is not paged): each question's prompt read whole, then each label
of more than one token read again with the prompt.

Unproven on a GPU until tests/gpu/test_gpu_decisions.py runs (against the transformers oracle, alone vs a burst).
"""

from __future__ import annotations

from typing import Any

from ...contract.decisions import LabelBranch, LabelLogprobs, LabelScoring
from ...errors import ServerBusyError
from .fast.deterministic import row_width
from .fast.requirements import PAGE_SIZE

LABEL_ROWS = 8
"""Labels (of more than one token) scored by one forward, as rows: bounds the logits one forward returns."""


def _logprobs(model: Any, ids: list[int], last: int) -> Any:
    """Log-probabilities (float64) of the last ``last`` positions of one row, vocabulary cropped to the model's."""
    import torch

    params: dict[str, Any] = {"attn_mode": "flash_attn_nc", "last_tokens_only": last}
    logits = model.forward(torch.tensor([ids], dtype=torch.long), params)
    logits = logits[0, -last:, : model.config.vocab_size]
    return torch.log_softmax(logits.double(), dim=-1).cpu()


def score_labels_nc(model: Any, job: LabelScoring) -> LabelLogprobs:
    """Each branch's labels' log-probabilities without a cache (see the module docstring)."""
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


def pages_needed(job: LabelScoring) -> int:
    """Pages the paged path borrows for ``job``: the longest question's, and one group of label rows' own."""
    shared = max(-(-(len(job.prefix) + len(b.suffix)) // PAGE_SIZE) for b in job.branches)
    own = 0
    for b in job.branches:
        start = len(job.prefix) + len(b.suffix)
        longest = max(len(lab) - 1 for lab in b.labels)
        if longest > 0:
            rows = min(LABEL_ROWS, sum(len(lab) > 1 for lab in b.labels))
            own = max(own, rows * (-(-(start % PAGE_SIZE + longest) // PAGE_SIZE)))
    return shared + own


def _table(pages: list[int], end: int) -> Any:
    """A one-row block table over ``pages`` as wide as exllamav3 gives a job alone whose next position is ``end``."""
    import torch

    width = row_width(end, PAGE_SIZE)
    row = pages[:width] + [pages[-1]] * max(0, width - len(pages))  # past the written positions: never read
    return torch.tensor([row], dtype=torch.int32)


class _Paged:
    """One job's forwards on borrowed pages (see the module docstring)."""

    def __init__(self, generator: Any, pages: list[int]) -> None:
        self.model, self.cache, self.pages = generator.model, generator.cache, pages

    def forward(self, ids: list[list[int]], tables: Any, seqlens: list[int], last: int | None) -> Any:
        import torch

        params: dict[str, Any] = {
            "attn_mode": "flash_attn",
            "block_table": tables,
            "cache": self.cache,
            "cache_seqlens": torch.tensor(seqlens, dtype=torch.int32),
        }
        if last is not None:
            params["last_tokens_only"] = last
        logits = self.model.forward(input_ids=torch.tensor(ids, dtype=torch.long), params=params)
        return torch.log_softmax(logits[..., : self.model.config.vocab_size].double(), dim=-1)  # on the device

    def prefix(self, ids: tuple[int, ...]) -> Any:
        """Read the prefix one page a forward (a job's prefix is never empty); the last position's log-probabilities."""
        last = None
        for start in range(0, len(ids), PAGE_SIZE):
            chunk = list(ids[start : start + PAGE_SIZE])
            last = self.forward([chunk], _table(self.pages, start + len(chunk) - 1), [start], 1)[0, -1]
        return last

    def branch(self, branch: LabelBranch, past: int, after_prefix: Any) -> tuple[float, ...]:
        start = past + len(branch.suffix)
        first = after_prefix
        if branch.suffix:
            first = self.forward([list(branch.suffix)], _table(self.pages, start - 1), [past], 1)[0, -1]
        import torch

        heads = torch.tensor([label[0] for label in branch.labels], device=first.device)
        scores = [float(v) for v in first[heads].tolist()]
        longer = [i for i, label in enumerate(branch.labels) if len(label) > 1]
        shared = start // PAGE_SIZE  # the question's pages before the one its labels start in
        used = -(-start // PAGE_SIZE)
        for g in range(0, len(longer), LABEL_ROWS):
            group = longer[g : g + LABEL_ROWS]
            width = max(len(branch.labels[i]) - 1 for i in group)
            per_row = -(-(start % PAGE_SIZE + width) // PAGE_SIZE)
            rows, tables = [], []
            for r, i in enumerate(group):
                own = self.pages[used + r * per_row : used + (r + 1) * per_row]
                if start % PAGE_SIZE:  # the question's tokens on its partial last page, copied to the row's own
                    self.cache.copy_page(self.cache, self.pages[shared], own[0], start % PAGE_SIZE)
                rest = list(branch.labels[i][:-1])
                rows.append(rest + [rest[-1]] * (width - len(rest)))  # padding after a row's tokens: never read
                tables.append(_table(self.pages[:shared] + own, start + width - 1)[0])
            lp = self.forward(rows, torch.stack(tables), [start] * len(group), None)
            at = [(r, k, t) for r, i in enumerate(group) for k, t in enumerate(branch.labels[i][1:])]
            picked = lp[[a[0] for a in at], [a[1] for a in at], [a[2] for a in at]].tolist()
            tails: dict[int, list[float]] = {}
            for (r, _, _), v in zip(at, picked):
                tails.setdefault(group[r], []).append(float(v))
            for i, values in tails.items():
                scores[i] += sum(values)  # the first token's, plus the rest's sum: as the cache-free path adds them
        return tuple(scores)


def score_labels_paged(generator: Any, job: LabelScoring) -> LabelLogprobs:
    """Each branch's labels' log-probabilities on borrowed pages (see the module docstring).

    Raises:
        ServerBusyError: the cache has fewer free pages than the job needs now (503; retry shortly).
    """
    table = generator.pagetable
    need = pages_needed(job)
    if table.num_unreferenced_pages() < need:
        raise ServerBusyError(
            f"the cache has no room for this decision now ({need} pages needed, "
            f"{table.num_unreferenced_pages()} free); retry shortly."
        )
    borrowed, _, _, _ = table.allocate_pages([], need, None)
    try:
        for page in borrowed:
            page.can_revert = False  # its K/V is overwritten: it must not come back as the prefix it held
        paged = _Paged(generator, [page.page_index for page in borrowed])
        after_prefix = paged.prefix(job.prefix)
        return tuple(paged.branch(b, len(job.prefix), after_prefix) for b in job.branches)
    finally:
        table.deallocate_pages(borrowed)


def score_labels(generator: Any, job: LabelScoring) -> LabelLogprobs:
    """The paged path, or the cache-free one for a model with recurrent layers (see the module docstring)."""
    model = generator.model
    if model.caps.get("recurrent_states"):
        return score_labels_nc(model, job)
    return score_labels_paged(generator, job)


__all__ = ["LABEL_ROWS", "pages_needed", "score_labels", "score_labels_nc", "score_labels_paged"]
