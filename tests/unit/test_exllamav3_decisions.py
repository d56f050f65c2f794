"""The exllamav3 paged label scoring's bookkeeping, against a fake paged model whose logits are a function of exactly
the tokens a position can see (read back through the block table from the fake cache's pages).

What a GPU cannot be replaced for (exllamav3's numbers) tests/gpu/test_gpu_decisions.py checks; here, that the
borrowed pages are addressed right: the prefix read once over a page boundary, each question written after it,
label rows on pages of their own with the question's partial page copied first, rows grouped and padded, the
tables as wide as the position needs; that the pages go back without their old prompt-cache identity; and that
a cache without room refuses typed. The paged path must give exactly the cache-free path's scores on this model.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from exllama_integrations.backends.exllamav3 import decisions
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
        self.forwards: list[tuple[str, int, int]] = []

    def forward(self, input_ids=None, params=None):
        ids = input_ids.tolist()
        mode, last = params["attn_mode"], params.get("last_tokens_only")
        rows = []
        for b, row in enumerate(ids):
            if mode == "flash_attn_nc":
                outs = [_logits(row[: k + 1]) for k in range(len(row))]
            else:
                assert params["cache"] is self.cache
                table, past = params["block_table"][b].tolist(), int(params["cache_seqlens"][b])
                self.forwards.append((mode, len(ids), len(table)))
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


def test_the_paged_path_gives_the_cache_free_paths_scores_exactly():
    gen = generator()
    want = decisions.score_labels_nc(gen.model, job())
    got = decisions.score_labels_paged(gen, job())
    assert got == want
    assert gen.cache.copies > 0  # the question's partial page was copied to the rows' own
    forwards = gen.model.forwards
    prefix_forwards = [f for f in forwards if f[1] == 1][:2]
    assert len(prefix_forwards) == 2  # 300 tokens: one page a forward, read once for the three questions
    assert max(f[1] for f in forwards) == decisions.LABEL_ROWS  # label rows batched, LABEL_ROWS a forward


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
    whole = decisions.score_labels_paged(generator(), job())
    for i, branch in enumerate(job().branches):
        alone = decisions.score_labels_paged(generator(), LabelScoring(job().prefix, (branch,)))
        assert alone[0] == whole[i]


def test_a_model_with_recurrent_layers_takes_the_cache_free_path():
    gen = generator()
    gen.model.caps = {"recurrent_states": True}
    assert decisions.score_labels(gen, job()) == decisions.score_labels_nc(gen.model, job())
    assert gen.model.forwards == [] and gen.pagetable.given_back == []
