"""The exllamav3 paged label scoring's forwards and page bookkeeping, against a fake paged model whose logits are a
function of exactly the tokens a position can see (read back through the block table from the fake cache's pages).

What a GPU cannot be replaced for (exllamav3's numbers) tests/gpu/test_gpu_decisions.py checks; here, that the plan
(``decision_plan.plan``) runs as it says and addresses the borrowed pages right: the prefix's full pages read once,
each question's prompt chunked by pages from position 0 as it is asked alone, a question under a page one forward
(its labels' rows fused with it), wider label rows on pages of their own with the question's partial page copied
first, every table as wide as exllamav3 gives a job alone; that the pages go back without their old prompt-cache
identity; and that a cache without room refuses typed. The paged path must give exactly the cache-free path's
scores on this model.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from exllama_integrations.backends.exllamav3 import decisions
from exllama_integrations.backends.exllamav3.decision_plan import plan
from exllama_integrations.backends.exllamav3.fast.deterministic import row_width
from exllama_integrations.backends.exllamav3.fast.requirements import PAGE_SIZE
from exllama_integrations.contract.decisions import LabelBranch, LabelScoring
from exllama_integrations.errors import ServerBusyError

VOCAB = 50


def _logits(visible: list[int]) -> torch.Tensor:
    h = 0
    for pos, t in enumerate(visible):
        h = (h * 131 + (t + 1) * (pos + 7)) % 1_000_003
    return torch.sin(torch.arange(VOCAB, dtype=torch.float64) * (h % 9973 + 1) / 97.0) * 4


class FakeModel:
    """Logits at a position: a function of the tokens 0..position of its row (as the cache holds them)."""

    caps: dict = {}

    def __init__(self, cache: FakeCache) -> None:
        self.cache = cache
        self.config = SimpleNamespace(vocab_size=VOCAB)
        self.forwards: list[tuple[int, list[list[int]], list[int]]] = []  # (start, rows' tokens, each row's width)

    def forward(self, input_ids=None, params=None):
        ids = input_ids.tolist()
        mode, last = params["attn_mode"], params.get("last_tokens_only")
        rows = []
        if mode != "flash_attn_nc":
            starts = params["cache_seqlens"].tolist()
            assert len(set(starts)) == 1  # a forward's rows start at one position
            self.forwards.append((starts[0], ids, [len(t) for t in params["block_table"].tolist()]))
        for b, row in enumerate(ids):
            if mode == "flash_attn_nc":
                outs = [_logits(row[: k + 1]) for k in range(len(row))]
            else:
                assert params["cache"] is self.cache
                table, past = params["block_table"][b].tolist(), int(params["cache_seqlens"][b])
                for k, t in enumerate(row):  # write the row's tokens where its table puts them
                    pos = past + k
                    self.cache.data[table[pos // PAGE_SIZE]][pos % PAGE_SIZE] = t
                outs = []
                for k in range(len(row)):
                    pos = past + k
                    seen = [self.cache.data[table[p // PAGE_SIZE]][p % PAGE_SIZE] for p in range(pos + 1)]
                    outs.append(_logits(seen))
            rows.append(torch.stack(outs[-last:] if last else outs))
        return torch.stack(rows).float().double()


class FakeCache:
    def __init__(self, pages: int) -> None:
        self.data = [[-1] * PAGE_SIZE for _ in range(pages)]
        self.copies = 0

    def copy_page(self, target, from_page, to_page, num_tokens):
        assert target is self
        self.copies += 1
        target.data[to_page][:num_tokens] = self.data[from_page][:num_tokens]


class FakePageTable:
    def __init__(self, pages: int, busy: int = 0) -> None:
        self.free = [SimpleNamespace(page_index=i, can_revert=True) for i in range(busy, pages)]
        self.given_back: list = []

    def num_unreferenced_pages(self) -> int:
        return len(self.free)

    def allocate_pages(self, page_hashes, new_unique_pages, recurrent_pages):
        assert page_hashes == [] and recurrent_pages is None
        taken, self.free = self.free[:new_unique_pages], self.free[new_unique_pages:]
        return taken, 0, 0, 0

    def deallocate_pages(self, allocated_pages):
        self.given_back.extend(allocated_pages)


def generator(pages: int = 64, busy: int = 0) -> SimpleNamespace:
    cache = FakeCache(pages)
    return SimpleNamespace(model=FakeModel(cache), cache=cache, pagetable=FakePageTable(pages, busy))


def job() -> LabelScoring:
    prefix = tuple(i % 40 for i in range(300))  # over a page boundary
    labels = tuple((3,) + tuple(range(5, 5 + n)) for n in range(11))  # 1 to 11 tokens: two groups of rows
    return LabelScoring(
        prefix,
        (
            LabelBranch((7, 8, 9), labels),
            LabelBranch(tuple(range(10, 30)), ((4,), (5, 6), (5, 7, 8))),
            LabelBranch((), ((1, 2), (2,))),  # no question tokens: the prefix's last logits
        ),
    )


def edge_jobs() -> list[LabelScoring]:
    """A prefix of exactly two pages (a question without tokens of its own ends on a shared page), a question
    longer than a page, a question whose labels' rows are over FUSED_TOKENS, and short prompts."""
    two_pages = tuple(i % 37 for i in range(2 * PAGE_SIZE))
    long_q = tuple(i % 23 for i in range(PAGE_SIZE + 40))
    wide = tuple((9, *(k % 47 for k in range(r, r + PAGE_SIZE // 2))) for r in range(3))  # 3 rows of 129 tokens
    return [
        LabelScoring(two_pages, (LabelBranch((), ((1, 2, 3), (2,), (4, 1))), LabelBranch((5,), ((1,), (2,))))),
        LabelScoring(tuple(range(40)), (LabelBranch(long_q, ((1, 2), (3,))), LabelBranch((6, 7), wide))),
        LabelScoring(tuple(range(60)), (LabelBranch(tuple(range(30)), ((4,), (5,))),)),
    ]


def test_the_paged_path_gives_the_cache_free_paths_scores_exactly():
    for j in [job(), *edge_jobs()]:
        gen = generator()
        want = decisions.score_labels_nc(gen.model, j)
        assert decisions.score_labels_paged(gen, j) == want
        assert len(gen.model.forwards) == decisions.forwards_needed(j)
    gen = generator()
    decisions.score_labels_paged(gen, job())
    assert gen.cache.copies > 0  # the question's partial page was copied to the label rows' own
    assert max(len(rows) for _, rows, _ in gen.model.forwards) == decisions.LABEL_ROWS  # LABEL_ROWS a forward


def test_a_question_under_a_page_is_one_forward_its_labels_fused():
    # the benchmark's one Choice on the demo model: 60 prefix tokens, 30 of its own, labels of 2, 1 and 2 tokens
    choice = LabelScoring(tuple(range(60)), (LabelBranch(tuple(range(60, 90)), ((3, 4), (5,), (6, 7))),))
    noul = LabelScoring(tuple(range(60)), (LabelBranch(tuple(range(60, 86)), ((3,), (5,))),))
    for j, rows in ((choice, 2), (noul, 1)):
        gen = generator()
        assert decisions.score_labels_paged(gen, j) == decisions.score_labels_nc(gen.model, j)
        ((start, ids, widths),) = gen.model.forwards  # before: the prefix, the question, the labels: 3 forwards
        assert start == 0 and len(ids) == rows and widths == [row_width(len(ids[0]) - 1, PAGE_SIZE)] * rows
        assert ids[0][:90] == list(range(90))[: len(ids[0])]


def test_the_prefixs_full_pages_are_read_once_and_each_question_is_chunked_by_pages_from_zero():
    for j in [job(), *edge_jobs()]:
        gen = generator()
        decisions.score_labels_paged(gen, j)
        full = len(j.prefix) // PAGE_SIZE
        shared = gen.model.forwards[:full]
        assert [(s, ids) for s, ids, _ in shared] == [
            (k * PAGE_SIZE, [list(j.prefix[k * PAGE_SIZE : (k + 1) * PAGE_SIZE])]) for k in range(full)
        ]
        # no other forward starts before the prefix's last full page ends: the shared pages are read once
        assert all(s >= full * PAGE_SIZE for s, _, _ in gen.model.forwards[full:])
        for s, ids, widths in gen.model.forwards:
            assert widths == [row_width(s + len(ids[0]) - 1, PAGE_SIZE)] * len(ids)  # as exllamav3 gives a job alone
        for b in j.branches:  # asked alone: its prompt one page a forward from 0, then label rows at its end
            alone = generator()
            decisions.score_labels_paged(alone, LabelScoring(j.prefix, (b,)))
            prompt = j.prefix + b.suffix
            chunks = [(s, ids[0]) for s, ids, _ in alone.model.forwards if s < len(prompt)]
            assert [s for s, _ in chunks] == list(range(0, len(prompt), PAGE_SIZE))
            assert [t for s, row in chunks for t in row[:PAGE_SIZE]][: len(prompt)] == list(prompt)
            assert all(s == len(prompt) for s, _, _ in alone.model.forwards if s >= len(prompt))


def test_borrowed_pages_go_back_fresh_and_a_full_cache_refuses_typed():
    gen = generator()
    decisions.score_labels_paged(gen, job())
    back = gen.pagetable.given_back
    assert len(back) == decisions.pages_needed(job()) and not any(p.can_revert for p in back)
    full = generator(pages=64, busy=64 - decisions.pages_needed(job()) + 1)
    with pytest.raises(ServerBusyError, match="retry"):
        decisions.score_labels_paged(full, job())
    assert full.pagetable.given_back == []


def test_a_question_is_computed_the_same_alone_and_beside_others():
    for j in [job(), *edge_jobs()]:
        whole = generator()
        got = decisions.score_labels_paged(whole, j)
        shared = len(j.prefix) // PAGE_SIZE
        own = []
        for i, branch in enumerate(j.branches):
            gen = generator()
            alone = decisions.score_labels_paged(gen, LabelScoring(j.prefix, (branch,)))
            assert alone[0] == got[i]
            assert gen.model.forwards[:shared] == whole.model.forwards[:shared]
            own += gen.model.forwards[shared:]
        # the request's forwards: the shared pages', then each question's own as it runs alone; no forward holds
        # two questions' tokens
        assert whole.model.forwards == whole.model.forwards[:shared] + own


def test_a_model_with_recurrent_layers_takes_the_cache_free_path():
    gen = generator()
    gen.model.caps = {"recurrent_states": True}
    assert decisions.score_labels(gen, job()) == decisions.score_labels_nc(gen.model, job())
    assert gen.model.forwards == [] and gen.pagetable.given_back == []


def test_the_plans_rows_write_pages_of_their_own_and_the_pages_borrowed_are_the_ones_used():
    for j in [job(), *edge_jobs()]:
        laid = plan(j)
        used = set()
        for step in laid.steps:
            written = [set(t[step.start // PAGE_SIZE : step.end // PAGE_SIZE + 1]) for t in step.tables]
            assert all(not (a & b) for i, a in enumerate(written) for b in written[i + 1 :])  # rows never collide
            assert all(len(t) == step.end // PAGE_SIZE + 1 for t in step.tables)  # a row's pages cover its positions
            used |= {s for t in step.tables for s in t}
        assert used == set(range(laid.pages))  # every page borrowed is used, none past them
