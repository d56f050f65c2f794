"""``deterministic=True``'s prefill in blocks of K pages: the plan, and exllamav3's own page table and prefill under it.

The plan's pure functions first (fast/chunk_plan.py). Then, with ``EXLLAMAV3_SOURCE`` set to an unpacked exllamav3
1.6.5 wheel, exllamav3's own ``Job`` (allocation, ``Job.prefill``'s chunking, ``hash_completed_page``) and
``PageTable`` (hash lookup, eviction, reuse), its extension and kernels stubbed: the model's ``prefill`` writes into
each cache position it computes the chunk that computed it (its bounds and tokens, what the K/V of a position depend
on besides the positions before it). A request's cache must then hold the same labels cold, after another prompt's
history (a match inside a block, a match of whole blocks and more), beside 15 other prompts arriving together, and on
a chat's next turn; exllamav3's own prefill (one chunk from the end of the cached prefix) is shown not to.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from exllama_integrations.backends.exllamav3.fast.chunk_plan import (
    block_pages,
    canonical_pages,
    chunks,
    plan,
    reused_pages,
)

P = 256  # exllamav3's page
K = 8  # pages a chunk: max_chunk_size 2048, exllamav3's own default


def test_a_chunk_is_whole_pages_and_every_chunk_starts_on_a_block() -> None:
    assert block_pages(2048, P) == 8 and block_pages(P, P) == 1
    for bad in (300, 128, 2048 + 1):
        with pytest.raises(ValueError, match="not a whole number"):
            block_pages(bad, P)
    assert chunks(3583, 0, K, P) == [(0, 2048), (2048, 3583)]  # the 3,584-token prompt: 2 forwards, as exllamav3's
    assert chunks(3583, 2048, K, P) == [(2048, 3583)]  # warm after a cached block: the same second chunk
    assert chunks(2048, 0, K, P) == [(0, 2048)] and chunks(0, 0, K, P) == []
    with pytest.raises(ValueError, match="not on a block"):
        chunks(3583, 3 * P, K, P)


def test_a_match_is_rounded_down_to_whole_blocks_and_only_whole_blocks_are_canonical() -> None:
    assert canonical_pages(3583, K, P) == 8  # the last 1,535 tokens' full pages: a shorter chunk, kept private
    assert canonical_pages(4096, K, P) == 16 and canonical_pages(2047, K, P) == 0
    assert reused_pages([True] * 11, 3583, K, P) == 8  # 11 pages found: the 3 inside block 1 computed again
    assert reused_pages([True] * 3 + [False] * 8, 3583, K, P) == 0
    assert reused_pages([True] * 8 + [False, True], 3583, K, P) == 8  # only the leading run counts
    assert reused_pages([True] * 20, 4000, K, P) == 8  # never past the prompt's own whole blocks
    assert reused_pages([True] * 3, 3583, 1, P) == 3  # one page a chunk: every page found is reused
    p = plan([True] * 11 + [False] * 2, 3583, K, P)
    assert (p.matched, p.reused, p.recomputed, p.chunks) == (11, 8, 3, ((2048, 3583),))


def test_cold_and_warm_compute_the_same_chunks_for_every_match() -> None:
    """Whatever the match, the chunks a warm prompt computes are the cold prompt's, less whole leading blocks."""
    for end in (255, 256, 2047, 2048, 2049, 3583, 5000, 8192):
        cold = chunks(end, 0, K, P)
        for found in range(0, end // P + 1):
            warm = plan([True] * found + [False], end, K, P)
            assert cold[len(cold) - len(warm.chunks) :] == list(warm.chunks), (end, found)
            assert warm.reused * P == (cold[len(cold) - len(warm.chunks)][0] if warm.chunks else warm.reused * P)
            assert 0 <= warm.recomputed < K or warm.reused == canonical_pages(end, K, P)


# ---------------------------------------------------------------------- exllamav3 1.6.5's own Job and PageTable


@pytest.fixture(scope="module")
def exl3() -> Iterator[Any]:
    source = os.environ.get("EXLLAMAV3_SOURCE")
    if not source:
        pytest.skip("set EXLLAMAV3_SOURCE to an unpacked exllamav3 1.6.5 wheel (pip download exllamav3==1.6.5)")
    pytest.importorskip("torch")
    root = Path(__file__).resolve().parents[2]
    before, path = set(sys.modules), list(sys.path)
    sys.path.insert(0, str(root / "tests" / "gpu"))
    try:
        from preflight_exllamav3 import _import_exllamav3

        _import_exllamav3(Path(source))
        import exllamav3.generator.job as job_module
        from exllamav3.generator.job import Job
        from exllamav3.generator.pagetable import PageTable

        def count_match_tensor(a: Any, b: Any, limit: int) -> int:  # the extension's, in Python
            n = min(int(limit), a.shape[-1], b.shape[-1])
            eq = (a[0, :n] == b[0, :n]).tolist()
            return next((i for i, e in enumerate(eq) if not e), n)

        job_module.ext.count_match_tensor = count_match_tensor
        yield types.SimpleNamespace(Job=Job, PageTable=PageTable)
    finally:  # the stubs (triton, the extension) must not outlive this module
        for name in set(sys.modules) - before:
            del sys.modules[name]
        sys.path[:] = path


class Cache:
    """The paged cache: per physical page, per position, the chunk that computed it (copy_page copies labels)."""

    def __init__(self, pages: int) -> None:
        self.max_num_tokens = pages * P
        self.labels: list[list[Any]] = [[None] * P for _ in range(pages)]

    def copy_page(self, target: Any, from_page: int, to_page: int, num_tokens: int) -> None:
        self.labels[to_page][:num_tokens] = self.labels[from_page][:num_tokens]


class Model:
    """``Model.prefill``: each position labelled with what a dense layer's K/V there depend on: the chunk's bounds
    (its GEMMs' row count, its attention's splits) and the tokens up to that position (causal, row by row)."""

    caps: dict[str, Any] = {}

    def __init__(self, cache: Cache) -> None:
        self.cache, self.chunks = cache, []

    def prefill(self, input_ids: Any, params: dict[str, Any]) -> None:
        start = int(params["cache_seqlens"][0])
        end = start + int(input_ids.shape[-1])
        table = params["block_table"][0].tolist()
        seen = params["seen"]
        self.chunks.append((start, end))
        for p in range(start, end):
            self.cache.labels[table[p // P]][p % P] = (start, end, seen[p])


class Generator:
    """What exllamav3's ``Job`` reads of its generator (no draft model, no recurrent cache, no tiers)."""

    def __init__(self, exl3: Any, pages: int = 96, chunk: int = K * P) -> None:
        self.cache = Cache(pages)
        self.model = Model(self.cache)
        self.max_total_tokens, self.max_draft_tokens, self.max_batch_size = pages * P, 0, 64
        self.max_chunk_size = chunk
        self.recurrent_cache = self.draft_model = self.ngram_corpus = None
        self.mtp_draft = self.dflash_draft = False
        self.ngram_match_min = self.hybrid_draft_tokens = 0
        self.padded_vocab_size = 8
        self.pagetable = exl3.PageTable(self, self.cache)


def run(exl3: Any, gen: Generator, prompts: list[list[int]], pins: Any = None) -> list[list[Any]]:
    """Start the prompts together, prefill them a chunk each per round (as ``iterate()``), free their pages; each
    prompt's labels, position by position."""
    import torch

    jobs = []
    for n, ids in enumerate(prompts):
        job = exl3.Job(torch.tensor([ids]), max_new_tokens=8)
        job.prepare_for_queue(gen, n)
        if pins is not None:
            pins.pin(job)
        assert job.current_new_pages_required() <= gen.pagetable.num_unreferenced_pages()
        job.allocate_pages()
        jobs.append(job)
    while not all(j.is_prefill_done() for j in jobs):
        for j in jobs:
            if not j.is_prefill_done():
                tokens = j.sequences[0].sequence_ids.torch()[0].tolist()
                gen.model.prefill = _labelled(gen.model, tokens)
                j.prefill([])
    out = []
    for j, ids in zip(jobs, prompts):
        seq = j.sequences[0]
        out.append([gen.cache.labels[seq.allocated_pages[p // P].page_index][p % P] for p in range(len(ids) - 1)])
        j.deallocate_pages()
    return out


def _labelled(model: Model, tokens: list[int]) -> Any:
    own, seen, h = Model.prefill, [], 0
    for t in tokens:  # a hash of the tokens up to each position
        h = hash((h, t))
        seen.append(h)

    def prefill(input_ids: Any, params: dict[str, Any]) -> None:
        own(model, input_ids, {**params, "seen": seen})

    return prefill


def _pins() -> Any:
    from exllama_integrations.backends.exllamav3.fast.deterministic import Pins
    from exllama_integrations.backends.exllamav3.fast.seam.prefix import AlignedPrefix

    return Pins(AlignedPrefix(K))


def ids(seed: int, n: int) -> list[int]:
    import random

    r = random.Random(seed)
    return [r.randrange(10, 30000) for _ in range(n)]


X = ids(1, 3584)  # the benchmark's first-token prompt length
HISTORIES = {
    "a match inside a block": X[: 3 * P] + ids(2, 3000),  # 3 pages shared, its own block 0 computed whole
    "whole blocks and 3 pages": X[: 11 * P + 5] + ids(3, 1500),  # block 0 and 3 pages (and 5 tokens) of block 1
    "the same prompt": list(X),
}


@pytest.mark.parametrize("history", list(HISTORIES))
def test_a_prompts_cache_is_its_cold_cache_after_any_history(exl3: Any, history: str) -> None:
    pins = _pins()
    cold_gen = Generator(exl3)
    (cold,) = run(exl3, cold_gen, [X], pins)
    assert cold_gen.model.chunks == [(0, 2048), (2048, 3583)]  # two forwards, as exllamav3's own cold prefill

    gen = Generator(exl3)
    run(exl3, gen, [HISTORIES[history]], pins)
    gen.model.chunks.clear()
    (warm,) = run(exl3, gen, [X], pins)
    assert warm == cold  # every position computed by the same chunk over the same tokens
    assert set(gen.model.chunks) <= {(0, 2048), (2048, 3583)}  # only the cold chunks, less a cached block
    assert all(a % (K * P) == 0 for a, _ in gen.model.chunks)

    own = Generator(exl3)  # exllamav3's own prefill: it starts at the end of the cached prefix
    run(exl3, own, [HISTORIES[history]])
    (theirs,) = run(exl3, own, [X])
    (own_cold,) = run(exl3, Generator(exl3), [X])
    if history != "the same prompt":
        assert theirs != own_cold  # what the rule removes


def test_the_rule_reuses_whole_blocks_and_says_what_it_computed_again(exl3: Any) -> None:
    pins = _pins()
    gen = Generator(exl3)
    run(exl3, gen, [HISTORIES["whole blocks and 3 pages"]], pins)  # 4,320 positions: pages 0..15 in whole blocks
    assert pins.blocks.report()["prompt_pages_kept_private"] == 0
    gen.model.chunks.clear()
    run(exl3, gen, [X], pins)
    report = pins.blocks.report()
    assert (report["pages_matched"], report["pages_reused"], report["pages_recomputed"]) == (11, 8, 3)
    assert gen.model.chunks == [(2048, 3583)]  # block 0 reused, block 1 computed as cold (its 3 cached pages too)
    assert report["prompt_pages_kept_private"] == 5  # X's pages 8..12: full, but of its 1,535-token last chunk
    gen.model.chunks.clear()
    run(exl3, gen, [X], pins)  # X again: the history's 11 pages found, never X's own private pages 11 and 12
    assert gen.model.chunks == [(2048, 3583)] and pins.blocks.report()["pages_matched"] == 11 + 11


def test_beside_15_prompts_arriving_together_a_prompts_cache_is_its_cold_cache(exl3: Any) -> None:
    pins = _pins()
    (cold,) = run(exl3, Generator(exl3, pages=160), [X], pins)
    others = [*HISTORIES.values(), *(ids(10 + i, 600 + 250 * i) for i in range(11)), X[:2500] + ids(9, 40)]
    prompts = others[:7] + [X] + others[7:]
    assert len(prompts) == 16
    gen = Generator(exl3, pages=160)
    got = run(exl3, gen, prompts, pins)
    assert got[7] == cold and got[2] == cold  # X, and the same prompt arriving beside it
    assert all(a % (K * P) == 0 for a, _ in gen.model.chunks)
    own = run(exl3, Generator(exl3, pages=160), prompts)  # exllamav3's own: X shares pages still being computed
    assert own[7] != run(exl3, Generator(exl3, pages=160), [X])[0]


def test_a_chats_next_turn_is_its_cold_next_turn(exl3: Any) -> None:
    pins = _pins()
    turn = X + ids(4, 300)  # the answer and the next message
    gen = Generator(exl3)
    run(exl3, gen, [X], pins)
    gen.model.chunks.clear()
    (warm,) = run(exl3, gen, [turn], pins)
    (cold,) = run(exl3, Generator(exl3), [turn], pins)
    assert warm == cold
    assert gen.model.chunks == [(2048, 3883)]  # the last turn's block 0 reused; its last 1,535 tokens computed again
    own = Generator(exl3)  # exllamav3's own: 13 pages reused, 255 positions copied from the 14th, then one chunk
    run(exl3, own, [X])
    own.model.chunks.clear()
    (theirs,) = run(exl3, own, [turn])
    assert own.model.chunks == [(3583, 3883)] and theirs != run(exl3, Generator(exl3), [turn])[0]


def test_what_docs_determinism_says_of_the_chunks_is_what_the_code_does() -> None:
    from exllama_integrations.backends.exllamav3.fast.deterministic import refuse_chunks
    from exllama_integrations.backends.exllamav3.fast.requirements import REQUIREMENTS, Reads
    from exllama_integrations.backends.exllamav3.options import ExLlamaV3Options, prefill_chunk

    page = " ".join((Path(__file__).resolve().parents[2] / "docs" / "determinism.md").read_text().split())
    chunk = prefill_chunk(ExLlamaV3Options(deterministic=True), 1 << 20)
    k = refuse_chunks(chunk, chunk)
    assert f"`max_chunk_size` ({chunk:,} tokens, {k} pages, by default" in page
    assert f"rounded down to a multiple of {k}" in page
    worst = max(plan([True] * n + [False], 1 << 16, k, P).recomputed for n in range(64))
    assert f"(at most {worst}, {worst * P:,} tokens)" in page and f"up to {worst} pages ({worst * P:,} tokens)" in page
    assert "A cold 3,584-token prompt takes the default's two forwards, `[0, 2048)` and `[2048, 3583)`" in page
    assert chunks(3583, 0, k, P) == [(0, 2048), (2048, 3583)]
    reads = {r.chain: r.times for r in REQUIREMENTS if isinstance(r, Reads) and r.cls == "Sequence"}
    assert reads == {"self.max_cached_pages": 2} and "`Sequence.allocate_pages` reads `max_cached_pages` twice" in page
    from exllama_integrations.backends.exllamav3.fast.seam.prefix import AlignedPrefix

    assert {"pages_matched", "pages_reused", "pages_recomputed"} <= set(AlignedPrefix(k).report())
    assert '`report()["prefill_blocks"]` counts the pages matched, reused and computed again' in page
