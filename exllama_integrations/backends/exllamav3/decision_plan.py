"""The paged label scoring's forwards as a pure function of a job (:func:`plan`): what each forward writes and reads.

A question's canonical computation is its prompt (the request's prefix, then the question's own tokens) chunked at
page boundaries from position 0, as deterministic prefill chunks a prompt (:mod:`.fast.deterministic`), each chunk a
forward after the pages before it; then its labels' tokens after their first. Every question of a request starts with
the same prefix, so the prefix's full pages are the same chunks for all of them: they are computed once, shared. The
rest of a question's prompt (the prefix's partial last page, then its own tokens) is its own, one page a forward, on
pages after the shared ones (each question overwrites the previous one's).

The question's last chunk (the page holding its last token) is where its labels start. The logits of its last
position score every label's first token (a label of one token costs nothing more). The rest of the labels of more
than one token:

* fused, where they are few (at most :data:`LABEL_ROWS`) and their rows small (at most :data:`FUSED_TOKENS` tokens
  in all): the last chunk and the labels are one forward, a row per such label (the chunk, then that label's tokens
  but its last), each row on pages of its own. So a question of a prompt under a page whose labels fuse is one
  forward;
* otherwise after the last chunk's own forward, as rows of forwards of :data:`LABEL_ROWS` labels, each row's table
  the question's pages then pages of its own, onto which the question's partial last page is copied first.

Either way a forward holds one question's tokens (or the shared prefix's) only, so it depends on that question's
tokens alone: the plan of a question asked alone is its plan inside any request. Several questions are never rows of
one forward: exllamav3 chooses its GEMMs' kernels by a forward's total rows (cuBLAS by ``(m, n, k)`` for fp16, the
EXL3 kernels by row bucket) and flash-attn its split by the batch, so a row's sums would depend on the other
questions' lengths (:mod:`.fast.pinned` pins those choices for decode steps of one token a row only).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...contract.decisions import LabelBranch, LabelScoring
from .fast.requirements import PAGE_SIZE

LABEL_ROWS = 8
"""Labels (of more than one token) scored by one forward, as rows: bounds the logits one forward returns."""

FUSED_TOKENS = 2 * PAGE_SIZE
"""The most tokens (rows times row length) of a question's last chunk fused with its labels' rows: fusing computes
the chunk once per row, which costs less than a forward of its own while the rows are this small."""


@dataclass(frozen=True)
class Read:
    """One log-probability a forward gives a label: of ``token`` at kept position ``at`` of row ``row``."""

    question: int
    label: int
    row: int
    at: int
    token: int


@dataclass(frozen=True)
class Step:
    """One forward: ``rows`` (one length; a row's padding after its tokens is never read) written from ``start``.

    ``tables``: each row's pages (slots of the borrowed pages, in order) from position 0; ``keep``: the last positions
    of every row whose log-probabilities are read; ``copies``: ``(from slot, to slot, tokens)`` copied first.
    """

    start: int
    rows: tuple[tuple[int, ...], ...]
    tables: tuple[tuple[int, ...], ...]
    keep: int
    reads: tuple[Read, ...] = ()
    copies: tuple[tuple[int, int, int], ...] = ()

    @property
    def end(self) -> int:
        """The rows' last position."""
        return self.start + len(self.rows[0]) - 1


@dataclass(frozen=True)
class Plan:
    """A job's forwards in order, and the pages (slots) they use."""

    steps: tuple[Step, ...]
    pages: int


def _pages(tokens: int) -> int:
    return -(-tokens // PAGE_SIZE)


def _firsts(q: int, branch: LabelBranch) -> tuple[Read, ...]:
    """Every label's first token, read at the last position of row 0."""
    return tuple(Read(q, j, 0, 0, label[0]) for j, label in enumerate(branch.labels))


def _fused(q: int, branch: LabelBranch, start: int, chunk: tuple[int, ...], table: list[int], slot: int) -> Step | None:
    """The question's last chunk and its labels' rest as rows of one forward, or None where they are too many."""
    multi = [j for j, label in enumerate(branch.labels) if len(label) > 1]
    width = max((len(branch.labels[j]) - 1 for j in multi), default=0)
    rows = max(1, len(multi))
    if len(multi) > LABEL_ROWS or rows * (len(chunk) + width) > FUSED_TOKENS:
        return None
    per_row = _pages(len(chunk) + width)  # (``start`` is a page boundary)
    ids, tables, reads = [], [], list(_firsts(q, branch))
    for r in range(rows):
        rest = list(branch.labels[multi[r]][:-1]) if multi else []
        ids.append(chunk + tuple(rest + rest[-1:] * (width - len(rest))))
        tables.append(tuple(table) + tuple(range(slot + r * per_row, slot + (r + 1) * per_row)))
        if multi:
            reads.extend(Read(q, multi[r], r, k, t) for k, t in enumerate(branch.labels[multi[r]][1:], 1))
    return Step(start, tuple(ids), tuple(tables), width + 1, tuple(reads))


def _label_rows(q: int, branch: LabelBranch, end: int, table: list[int], slot: int) -> tuple[list[Step], int]:
    """The labels' rest after a prompt of ``end`` tokens on ``table``, :data:`LABEL_ROWS` rows a forward."""
    multi = [j for j, label in enumerate(branch.labels) if len(label) > 1]
    shared, partial = table[: end // PAGE_SIZE], end % PAGE_SIZE
    steps: list[Step] = []
    used = slot
    for g in range(0, len(multi), LABEL_ROWS):
        group = multi[g : g + LABEL_ROWS]
        width = max(len(branch.labels[j]) - 1 for j in group)
        per_row = _pages(partial + width)
        ids: list[tuple[int, ...]] = []
        tables: list[tuple[int, ...]] = []
        reads: list[Read] = []
        copies: list[tuple[int, int, int]] = []
        for r, j in enumerate(group):
            own = tuple(range(slot + r * per_row, slot + (r + 1) * per_row))
            if partial:  # the question's tokens on its partial last page, copied to the row's own
                copies.append((table[-1], own[0], partial))
            rest = list(branch.labels[j][:-1])
            ids.append(tuple(rest + rest[-1:] * (width - len(rest))))
            tables.append(tuple(shared) + own)
            reads.extend(Read(q, j, r, k, t) for k, t in enumerate(branch.labels[j][1:]))
        steps.append(Step(end, tuple(ids), tuple(tables), width, tuple(reads), tuple(copies)))
        used = max(used, slot + len(group) * per_row)
    return steps, used


def _question(q: int, branch: LabelBranch, prefix: tuple[int, ...], shared: int) -> tuple[list[Step], int]:
    """One question's forwards after the shared pages, and the slots they use."""
    prompt = prefix + branch.suffix
    last = (len(prompt) - 1) // PAGE_SIZE * PAGE_SIZE  # where the chunk holding the last token starts
    table, slot, steps = list(range(shared)), shared, []
    if last < shared * PAGE_SIZE:  # the prompt ends with the prefix's last full page: its logits were read there
        more, used = _label_rows(q, branch, len(prompt), table, slot)
        return more, used
    for start in range(shared * PAGE_SIZE, last, PAGE_SIZE):  # its own full pages, one a forward
        table.append(slot)
        slot += 1
        steps.append(Step(start, (prompt[start : start + PAGE_SIZE],), (tuple(table),), 1))
    fused = _fused(q, branch, last, prompt[last:], table, slot)
    if fused is not None:
        return [*steps, fused], slot + len(fused.rows) * _pages(len(fused.rows[0]))
    table.append(slot)
    steps.append(Step(last, (prompt[last:],), (tuple(table),), 1, _firsts(q, branch)))
    more, used = _label_rows(q, branch, len(prompt), table, slot + 1)
    return [*steps, *more], used


def plan(job: LabelScoring) -> Plan:
    """The job's forwards (see the module docstring): the prefix's full pages once, then each question's own."""
    prefix, shared = job.prefix, len(job.prefix) // PAGE_SIZE
    ends_there = [q for q, b in enumerate(job.branches) if not b.suffix and shared and not len(prefix) % PAGE_SIZE]
    steps: list[Step] = []
    for k in range(shared):
        reads = [r for q in ends_there for r in _firsts(q, job.branches[q])] if k == shared - 1 else []
        chunk = prefix[k * PAGE_SIZE : (k + 1) * PAGE_SIZE]
        steps.append(Step(k * PAGE_SIZE, (chunk,), (tuple(range(k + 1)),), 1, tuple(reads)))
    pages = shared
    for q, branch in enumerate(job.branches):
        more, used = _question(q, branch, prefix, shared)
        steps.extend(more)
        pages = max(pages, used)
    return Plan(tuple(steps), pages)


__all__ = ["FUSED_TOKENS", "LABEL_ROWS", "Plan", "Read", "Step", "plan"]
