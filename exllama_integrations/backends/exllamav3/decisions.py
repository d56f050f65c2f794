"""Label scoring on exllamav3 (decision questions), on the driver's thread between steps.

The paged path (:func:`score_labels_paged`) runs the forwards :func:`.decision_plan.plan` lays out: the prefix's full
pages once for every question of the request, one page a forward; then each question's prompt from there (the
prefix's partial last page and the question's own tokens) chunked at page boundaries, its last chunk's logits scoring
every label's first token, and the rest of each label of more than one token as rows (in the last chunk's forward
where they are few and small, else in forwards of their own on copies of the question's partial page). A question
whose prompt is under a page, its labels fused, is one forward. It borrows pages of the generator's cache that no
job references (``PageTable.allocate_pages`` with no hashes: fresh pages, as a new job's own; evicting prompt-cache
pages as a job would), and gives them back when done; every read log-probability comes to the host once, at the end.

The pages' K/V is overwritten, so no page keeps its old prompt-cache identity (``can_revert`` is cleared: a page
given back becomes a fresh unreferenced page, never a cached prefix). Batch invariance follows the deterministic
path's rules (:mod:`.fast.deterministic`): every forward holds one question's rows only (or the shared prefix's),
each question's prompt is chunked by pages from position 0, and each table's width is the one exllamav3 gives a job
alone at that position (:func:`~.fast.deterministic.row_width`), so a question's numbers depend on its own tokens,
never on the other questions of its request or on what else the generator runs (the plan says why several questions
are never rows of one forward). Where the cache has no room for the job now, the request is refused typed (503,
retry) rather than answered on another path with other rounding.

The cache-free path (:func:`score_labels_nc`, ``attn_mode="flash_attn_nc"``, as the yes/no reranker reads its logits)
serves models with recurrent layers (their state is not paged): each question's prompt read whole, then each label
of more than one token read again with the prompt.
"""

from __future__ import annotations

from typing import Any

from ...contract.decisions import LabelLogprobs, LabelScoring
from ...errors import ServerBusyError
from .decision_plan import LABEL_ROWS, Step, plan
from .fast.deterministic import row_width
from .fast.requirements import PAGE_SIZE


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
    """Pages the paged path borrows for ``job`` (:func:`.decision_plan.plan`)."""
    return plan(job).pages


def forwards_needed(job: LabelScoring) -> int:
    """Forwards the paged path runs for ``job`` (:func:`.decision_plan.plan`)."""
    return len(plan(job).steps)


def _table(pages: list[int], end: int) -> list[int]:
    """A row's block table over ``pages`` as wide as exllamav3 gives a job alone whose next position is ``end``."""
    width = row_width(end, PAGE_SIZE)
    return pages[:width] + [pages[-1]] * max(0, width - len(pages))  # past the written positions: never read


def _run(generator: Any, pages: list[int], steps: tuple[Step, ...]) -> list[float]:
    """Each step's forward on ``pages``; its reads' log-probabilities, in the steps' order (one copy to the host)."""
    import torch

    model, cache = generator.model, generator.cache
    picked = []
    for step in steps:
        for src, dst, tokens in step.copies:  # a question's partial last page, to a label row's own
            cache.copy_page(cache, pages[src], pages[dst], tokens)
        tables = [_table([pages[s] for s in slots], step.end) for slots in step.tables]
        params: dict[str, Any] = {
            "attn_mode": "flash_attn",
            "block_table": torch.tensor(tables, dtype=torch.int32),
            "cache": cache,
            "cache_seqlens": torch.tensor([step.start] * len(step.rows), dtype=torch.int32),
            "last_tokens_only": step.keep,
        }
        logits = model.forward(input_ids=torch.tensor(step.rows, dtype=torch.long), params=params)
        if step.reads:  # the distributions at the positions read only (float64, vocabulary cropped to the model's)
            spots = {(x.row, x.at): None for x in step.reads}
            index = {spot: i for i, spot in enumerate(spots)}
            kept = logits[:, -step.keep :][[r for r, _ in spots], [a for _, a in spots]]
            lp = torch.log_softmax(kept[:, : model.config.vocab_size].double(), dim=-1)
            picked.append(lp[[index[(x.row, x.at)] for x in step.reads], [x.token for x in step.reads]])
    return torch.cat(picked).tolist() if picked else []


def score_labels_paged(generator: Any, job: LabelScoring) -> LabelLogprobs:
    """Each branch's labels' log-probabilities on borrowed pages (see the module docstring).

    Raises:
        ServerBusyError: the cache has fewer free pages than the job needs now (503; retry shortly).
    """
    laid = plan(job)
    table = generator.pagetable
    if table.num_unreferenced_pages() < laid.pages:
        raise ServerBusyError(
            f"the cache has no room for this decision now ({laid.pages} pages needed, "
            f"{table.num_unreferenced_pages()} free); retry shortly."
        )
    borrowed, _, _, _ = table.allocate_pages([], laid.pages, None)
    try:
        for page in borrowed:
            page.can_revert = False  # its K/V is overwritten: it must not come back as the prefix it held
        values = _run(generator, [page.page_index for page in borrowed], laid.steps)
    finally:
        table.deallocate_pages(borrowed)
    first: dict[tuple[int, int], float] = {}
    rest: dict[tuple[int, int], list[float]] = {}
    for read, value in zip((r for s in laid.steps for r in s.reads), values):
        key = (read.question, read.label)
        if key in first:
            rest.setdefault(key, []).append(value)
        else:  # a label's first token is its first read (the plan reads the first tokens before the rest)
            first[key] = value
    out = []
    for q, branch in enumerate(job.branches):
        scores = []
        for j in range(len(branch.labels)):
            total = first[(q, j)]
            if (q, j) in rest:
                total += sum(rest[(q, j)])  # the first token's, plus the rest's sum: as the cache-free path adds them
            scores.append(total)
        out.append(tuple(scores))
    return tuple(out)


def score_labels(generator: Any, job: LabelScoring) -> LabelLogprobs:
    """The paged path, or the cache-free one for a model with recurrent layers (see the module docstring)."""
    model = generator.model
    if model.caps.get("recurrent_states"):
        return score_labels_nc(model, job)
    return score_labels_paged(generator, job)


__all__ = ["LABEL_ROWS", "forwards_needed", "pages_needed", "score_labels", "score_labels_nc", "score_labels_paged"]
