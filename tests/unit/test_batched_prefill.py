"""decode="fast": the prompt chunks of one iterate() held and run in a few batched forwards (batched_prefill).

A paged cache in miniature stands in for exllamav3's: the fake model's prefill writes each row's token ids at its
positions through its block table (as K/V would be written) and checks that every position a row attends to
(before its chunk) was written first; its decode forward checks each row's whole prompt. Jobs chunk their prompts
as exllamav3's Job.prefill does and keep its page bookkeeping (ref_count, kv_position) at once, before the held
forward has run. The GPU tests run the same rule on exllamav3 itself (tests/gpu/test_gpu_fast_decode.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from exllama_integrations.backends.exllamav3.fast import decode as fast_decode
from exllama_integrations.backends.exllamav3.fast import prefill as batched_prefill
from exllama_integrations.backends.exllamav3.fast.prefill import BatchedPrefill, Chunk, groups

PAGE = 4


@pytest.fixture(autouse=True)
def _small_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast path hooks the fake generator (its seam's check stands in for an installed exllamav3), with pages
    of 4 tokens."""
    monkeypatch.setattr(fast_decode, "stands_aside", lambda: None)
    monkeypatch.setattr(batched_prefill, "page_size", lambda: PAGE)


def hooked(gen: Generator) -> BatchedPrefill:
    """``gen`` hooked by the fast path with batched prefill on (graphs off: there are none on CPU); its prefill."""
    fast = fast_decode.FastDecode(gen, graphs=False, prefill=True)
    assert fast.active and fast.prefill is not None
    gen.fast = fast
    return fast.prefill


class Page:
    def __init__(self, index: int) -> None:
        self.page_index, self.ref_count, self.kv_position = index, 0, 0
        self.sequence = torch.zeros((1, PAGE), dtype=torch.long)  # the ids whose K/V the page holds


class PagedModel:
    """Prefill writes ids into the cache; attention reads the positions before each row's chunk."""

    def __init__(self, pages: int, fail_batched: bool = False) -> None:
        self.cache = torch.full((pages, PAGE), -1, dtype=torch.long)
        self.calls: list[tuple[int, int]] = []  # (rows, width) of each prefill forward
        self.fail_batched = fail_batched
        self.forwards = 0

    def _read(self, table: Any, upto: int) -> list[int]:
        return [int(self.cache[int(table[p // PAGE]), p % PAGE]) for p in range(upto)]

    def prefill(self, input_ids: Any, params: dict[str, Any]) -> Any:
        if self.fail_batched and input_ids.shape[0] > 1:
            raise RuntimeError("no kernel for this shape")
        self.calls.append((int(input_ids.shape[0]), int(input_ids.shape[1])))
        rows = range(input_ids.shape[0])
        for row in rows:  # one forward: every row reads the cache as it was before the forward
            table, start = params["block_table"][row], int(params["cache_seqlens"][row])
            assert -1 not in self._read(table, start), "a chunk attended to positions not yet written"
        for row in rows:
            table, start = params["block_table"][row], int(params["cache_seqlens"][row])
            for j in range(input_ids.shape[1]):
                p = start + j
                self.cache[int(table[p // PAGE]), p % PAGE] = input_ids[row, j]
        return "hidden states Job.prefill ignores"

    def prefetch_tokens(self, ids: list[int]) -> None:
        pass

    def forward(self, input_ids: Any, params: dict[str, Any]) -> Any:
        self.forwards += 1
        for job in params["jobs"]:
            assert self._read(job.table[0], len(job.prompt) - 1) == job.prompt[:-1], "decode read an unwritten cache"
        return torch.zeros(len(params["jobs"]), 1, 8)


class Cache:
    def __init__(self, model: PagedModel) -> None:
        self.model = model
        self.copies = 0

    def copy_page(self, source: Any, from_page: int, to_page: int, num_tokens: int) -> None:
        assert -1 not in self.model.cache[from_page, :num_tokens].tolist(), "copied a page not yet written"
        self.model.cache[to_page, :num_tokens] = self.model.cache[from_page, :num_tokens]
        self.copies += 1


class Job:
    """exllamav3's Job.prefill in miniature: chunks of at most max_chunk_size, bookkeeping at once."""

    def __init__(self, gen: Generator, prompt: list[int], pages: list[int]) -> None:
        self.gen, self.prompt, self.kv = gen, prompt, 0
        self.table = torch.tensor([pages], dtype=torch.int32)
        for p in pages:
            gen.page(p).ref_count += 1
        self.extra: dict[str, Any] = {}
        self.counted = False  # its last prompt token counted in its page (the decode step's input)

    def done(self) -> bool:
        return self.kv >= len(self.prompt) - 1

    def prefill(self) -> None:
        if self.done():
            return
        end = min(self.kv + self.gen.max_chunk_size, len(self.prompt) - 1)
        if end < len(self.prompt) - 1:
            end = end // PAGE * PAGE
        params = {
            "attn_mode": "flash_attn",
            "block_table": self.table,
            "cache": self.gen.cache,
            "cache_seqlens": torch.tensor([self.kv], dtype=torch.int32),
            "recurrent_states": None,
            "indexed_embeddings": [],
            "inv_freq": None,
            "mm_span_prefix": 0,
            **self.extra,
        }
        out = self.gen.model.prefill(input_ids=torch.tensor([self.prompt[self.kv : end]]), params=params)
        del out  # Job.prefill does not use it
        for k in range(self.kv // PAGE, -(-end // PAGE)):
            page = self.gen.page(int(self.table[0, k]))
            page.kv_position = max(page.kv_position, min(PAGE, end - k * PAGE))
            for pos in range(max(self.kv, k * PAGE), min(end, (k + 1) * PAGE)):
                page.sequence[0, pos % PAGE] = self.prompt[pos]
        self.kv = end

    def reuse(self, source: Job, tokens: int) -> None:
        """Job.prefill's partial-page reuse: the first ``tokens`` of its first page copied from ``source``'s."""
        dst = int(self.table[0, 0])
        self.gen.cache.copy_page(self.gen.cache, int(source.table[0, 0]), dst, tokens)
        self.gen.page(dst).sequence[0, :tokens] = torch.tensor(self.prompt[:tokens])
        self.kv = tokens


class Generator:
    def __init__(
        self, pages: int = 64, max_chunk_size: int = 16, fail_batched: bool = False, decode: bool = False
    ) -> None:
        self.model = PagedModel(pages, fail_batched)
        self.decode = decode  # whether iterate() runs a decode forward (one the fast path hooks)
        self.cache = Cache(self.model)
        self.pagetable = type("PT", (), {"all_pages": [Page(i) for i in range(pages)]})()
        self.max_chunk_size = max_chunk_size
        self.active_jobs: list[Job] = []
        self.pending_jobs: list[Job] = []
        self.draft_model = None
        self.recurrent_cache = None
        self.tokenizer = type("T", (), {"actual_vocab_size": 8})()
        self.next_page = 0
        self.fast: Any = None

    def page(self, index: int) -> Page:
        return next(p for p in self.pagetable.all_pages if p.page_index == index)

    def job(self, n: int, seed: int, pages: int | None = None) -> Job:
        prompt = torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
        need = pages if pages is not None else -(-(n + 4) // PAGE)  # prompt and a few new tokens
        job = Job(self, prompt, list(range(self.next_page, self.next_page + need)))
        self.next_page += need
        self.active_jobs.append(job)
        return job

    def iterate(self) -> None:
        for job in self.active_jobs:
            job.prefill()
        for job in self.active_jobs:  # exllamav3 counts each job's next input in its page before the decode forward
            if job.done() and not job.counted:
                end = len(job.prompt) - 1
                page = self.page(int(job.table[0, end // PAGE]))
                page.sequence[0, end % PAGE], page.kv_position = job.prompt[-1], end % PAGE + 1
                job.counted = True
        if self.decode:
            self.iterate_gen([])

    def iterate_gen(self, results: list[Any], draft_tokens: Any = None) -> None:
        ready = [j for j in self.active_jobs if j.done()]
        if ready:
            self.model.forward(torch.zeros(len(ready), 1, dtype=torch.long), {"jobs": ready})


def written(gen: Generator) -> dict[int, list[int]]:
    """What each job's cache holds at its prompt's positions (the prefill's K/V, in miniature)."""
    return {id(j): gen.model._read(j.table[0], len(j.prompt) - 1) for j in gen.active_jobs}


def test_the_prompts_of_one_step_prefill_in_a_few_forwards_and_the_cache_holds_the_same() -> None:
    gen = Generator()
    jobs = [gen.job(n, seed) for seed, n in enumerate([8, 7, 7, 8, 6, 3, 12])]
    prefill = hooked(gen)
    gen.iterate()
    # the longest first, at most 16 rows a forward, at most a quarter of them padding
    assert gen.model.calls == [(1, 11), (2, 7), (2, 6), (1, 5), (1, 2)]
    assert written(gen) == {id(j): j.prompt[:-1] for j in jobs}
    report = prefill.report()
    assert report["chunks_held"] == 7 and report["forwards_of_several"] == 2 and report["chunks_in_them"] == 4
    assert report["padding_rows"] == 0 and report["run_alone"] == {"alone in its forward": 3}
    assert report["run_before"] == {"the end of iterate()": 1}
    assert not prefill.held  # nothing is held between calls of iterate()


def test_the_decode_forward_runs_after_the_held_chunks() -> None:
    """Through the fast path: the forward of the step the prompts join reads every row's prompt."""
    gen = Generator(decode=True)
    for seed, n in enumerate([6, 6, 6]):
        gen.job(n, seed)
    hooked(gen)
    gen.iterate()
    assert gen.model.forwards == 1 and gen.model.calls == [(3, 5)]
    assert gen.fast.report()["prefill"]["run_before"] == {"a model forward": 1}


def test_prompts_are_prefilled_job_by_job_unless_batched_prefill_is_asked_for() -> None:
    gen = Generator(decode=True)
    for seed, n in enumerate([6, 6, 6]):
        gen.job(n, seed)
    fast = fast_decode.FastDecode(gen, graphs=False)  # the default: exllamav3's own prefill
    gen.iterate()
    assert gen.model.calls == [(1, 5)] * 3 and "prefill" not in vars(gen.model)
    assert fast.report()["prefill"] == {"batched": False, "stands_aside": "off"}


def test_padding_stays_in_pages_the_row_alone_holds_past_what_is_valid() -> None:
    gen = Generator(max_chunk_size=32)
    long = gen.job(9, 1)  # 8 rows: the width of the forward
    short = gen.job(7, 2)  # 6 rows: padding at positions 6 and 7, in its second page
    shared = gen.job(7, 3)  # the same, but its second page is another job's too
    gen.page(int(shared.table[0, 1])).ref_count += 1
    hooked(gen)
    gen.iterate()
    assert gen.model.calls == [(2, 8), (1, 6)]  # the shared page keeps the third chunk out of the padded forward
    assert written(gen) == {id(j): j.prompt[:-1] for j in (long, short, shared)}
    assert gen.model.cache[int(shared.table[0, 1]), 2:].tolist() == [-1, -1]  # nothing written past its chunk


def test_a_row_whose_padding_would_pass_its_pages_runs_in_its_own_forward() -> None:
    for pages, calls in ((2, [(3, 8)]), (1, [(2, 8), (1, 3)])):
        gen = Generator(max_chunk_size=32)
        gen.job(9, 1)  # 8 rows: the width of the forward
        gen.job(9, 3)
        short = gen.job(4, 2, pages=pages)  # 3 rows: padding at positions 3..7, 4..7 in its second page (if any)
        hooked(gen)
        gen.iterate()
        assert gen.model.calls == calls
        assert written(gen)[id(short)] == short.prompt[:-1]


def test_a_chunk_over_pages_a_held_one_writes_waits_for_it() -> None:
    gen = Generator()
    first = gen.job(9, 1)
    # a second job whose table starts with the first's two pages (a shared prefix, allocated while it is written)
    second = Job(gen, first.prompt[:8] + [5, 6, 7], [int(p) for p in first.table[0, :2]] + [40])
    gen.active_jobs.append(second)
    second.kv = 8  # exllamav3 skips the full pages another job is writing; its chunk attends to them
    prefill = hooked(gen)
    gen.iterate()  # the fake model asserts the second chunk read written positions only
    assert prefill.report()["run_before"]["a chunk over pages a held one writes"] == 1
    assert written(gen)[id(second)] == second.prompt[:-1]


def test_prompts_sharing_a_page_prefill_together_the_copy_computed_in_the_forward() -> None:
    """exllamav3 copies the K/V of a partly matching page from a job prefilled before; when that job's chunk is held,
    the copy is held too, and the job that copies computes those positions itself, in the same forward."""
    gen = Generator()
    a = gen.job(7, 1)
    b = gen.job(7, 2)
    b.prompt[:3] = a.prompt[:3]  # a shared beginning: 3 tokens of a's first page
    prefill = hooked(gen)
    a.prefill()
    b.reuse(a, 3)  # copy_page from a's page, which a's held chunk writes
    b.prefill()  # its chunk starts at position 3: it reaches back to 0
    gen.iterate()
    assert gen.model.calls == [(2, 6)] and gen.cache.copies == 0
    assert written(gen) == {id(j): j.prompt[:-1] for j in (a, b)}
    assert prefill.report()["page_copies_computed"] == 1


def test_a_held_page_copy_with_no_chunk_after_it_runs_after_the_forward() -> None:
    gen = Generator()
    a = gen.job(7, 1)
    gen.job(7, 2)
    hooked(gen)
    for job in gen.active_jobs:
        job.prefill()
    gen.cache.copy_page(gen.cache, int(a.table[0, 0]), 60, 3)  # a whole prompt matched: no chunk follows
    assert gen.cache.copies == 0  # held: its source is not written yet
    gen.iterate()  # the fake cache asserts the copy read written positions
    assert gen.cache.copies == 1 and gen.model.cache[60, :3].tolist() == a.prompt[:3]


def test_a_page_copy_from_a_written_page_runs_at_once() -> None:
    gen = Generator()
    a = gen.job(7, 1)
    prefill = hooked(gen)
    gen.iterate()
    gen.job(7, 2).prefill()  # held
    gen.cache.copy_page(gen.cache, int(a.table[0, 0]), 60, 3)
    assert gen.cache.copies == 1 and len(prefill.held) == 1
    gen.cache.copy_page(gen.cache, 60, int(gen.active_jobs[1].table[0, 1]), 2)  # into a page the held chunk writes
    assert prefill.report()["run_before"]["a page copy"] == 1 and not prefill.held


def test_padding_finds_pages_moved_by_a_defragmentation() -> None:
    gen = Generator()
    gen.job(9, 1)
    short = gen.job(7, 2)
    gen.pagetable.all_pages.reverse()  # exllamav3's defragmentation renumbers pages: found by page_index
    hooked(gen)
    gen.iterate()
    assert gen.model.calls == [(2, 8)]
    assert written(gen)[id(short)] == short.prompt[:-1]


def test_a_prompt_longer_than_a_chunk_goes_on_at_the_next_step() -> None:
    gen = Generator(max_chunk_size=8)
    long = gen.job(20, 1)
    other = gen.job(8, 2)
    hooked(gen)
    gen.iterate()
    assert gen.model.calls == [(1, 8), (1, 7)]  # 16 rows of 8 would pass max_chunk_size: one forward each
    gen.iterate()
    gen.iterate()
    assert written(gen) == {id(long): long.prompt[:-1], id(other): other.prompt[:-1]}


def test_a_failing_batched_forward_falls_back_to_one_by_one_and_turns_itself_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gen = Generator(fail_batched=True)
    jobs = [gen.job(6, seed) for seed in range(3)]
    prefill = hooked(gen)
    gen.iterate()
    assert written(gen) == {id(j): j.prompt[:-1] for j in jobs}
    assert gen.model.calls == [(1, 5)] * 3
    assert not prefill.on and prefill.report()["run_alone"]["off: a batched prefill failed"] == 1
    assert "prefilled one by one" in caplog.text
    later = [gen.job(6, seed) for seed in (7, 8)]
    gen.iterate()
    assert written(gen)[id(later[1])] == later[1].prompt[:-1]
    assert prefill.report()["run_alone"]["batched prefill off"] == 2


def test_what_is_not_a_plain_text_chunk_runs_as_exllamav3_runs_it() -> None:
    gen = Generator()
    plain = gen.job(6, 1)
    image = gen.job(6, 2)
    image.extra = {"indexed_embeddings": ["an image"]}
    prefill = hooked(gen)
    gen.iterate()
    assert gen.model.calls == [(1, 5), (1, 5)]
    assert prefill.report()["run_alone"] == {"images, MRoPE or recurrent states": 1, "alone in its step": 1}
    assert prefill.report()["run_before"] == {"a prefill that cannot be held": 1}
    assert written(gen)[id(plain)] == plain.prompt[:-1]


@pytest.mark.parametrize(
    ("attr", "why"),
    [("draft_model", "a draft model"), ("recurrent_cache", "a recurrent cache"), ("cpu_page_cache", "host page")],
)
def test_generators_it_cannot_hold_for_are_left_alone_and_say_why(attr: str, why: str) -> None:
    gen = Generator()
    setattr(gen, attr, object())
    gen.job(6, 1)
    gen.job(6, 2)
    prefill = hooked(gen)
    assert why in prefill.report()["stands_aside"]
    gen.iterate()
    assert gen.model.calls == [(1, 5), (1, 5)]
    assert "prefill" not in vars(gen.model)


def test_close_unhooks_the_generator() -> None:
    gen = Generator()
    hooked(gen)
    assert {"prefill"} <= set(vars(gen.model)) and "iterate" in vars(gen) and "copy_page" in vars(gen.cache)
    gen.fast.close()
    assert "prefill" not in vars(gen.model) and "iterate" not in vars(gen) and "copy_page" not in vars(gen.cache)


def test_groups_take_the_longest_first_within_the_rows_and_the_padding() -> None:
    def chunk(n: int) -> Chunk:
        return Chunk(
            torch.zeros(1, n, dtype=torch.long), {"block_table": torch.zeros(1, 8), "cache_seqlens": torch.tensor([0])}
        )

    lengths = [10, 9, 3, 10, 8, 10]
    got = groups([chunk(n) for n in lengths], 40, lambda c, w: True)
    assert [[c.length for c in g] for g in got] == [[10, 10, 10, 9], [8], [3]]
    # a chunk that may not be padded starts its own forward
    got = groups([chunk(n) for n in lengths], 40, lambda c, w: False)
    assert [[c.length for c in g] for g in got] == [[10, 10, 10], [9], [8], [3]]
    got = groups([chunk(n) for n in lengths], 25, lambda c, w: True)  # two rows of 10 at most
    assert [[c.length for c in g] for g in got] == [[10, 10], [10, 9], [8], [3]]
