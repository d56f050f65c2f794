"""The batched sampler of ``decode="fast"`` against the reference sampler (our logits processors), and its rule.

The reference is :func:`exllama_integrations.backends.logits.logits_processors` (transformers' processors, the
sampler every logits backend uses; exllamav3's ComboSampler applies the same steps in the same order for the
settings below, and the H200 run of benchmarks/gpu_fast_decode.py compares against ComboSampler itself). Greedy
must pick the reference's token on every row; sampled draws must follow the reference's distribution (a
chi-square goodness-of-fit over 4,000 draws per setting, seeds fixed: the test is deterministic). A small
vocabulary keeps it fast on CPU.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from exllama_integrations.backends.exllamav3.fast import decode as fast_decode  # noqa: E402
from exllama_integrations.backends.exllamav3.fast.sampler import (  # noqa: E402
    BatchedSampler,
    RowSettings,
    row_settings,
    uncovered,
)
from exllama_integrations.backends.logits import logits_processors  # noqa: E402
from exllama_integrations.contract.settings import GenerationSettings  # noqa: E402

VOCAB = 96
PROMPT = 6


def reference_scores(logits: Any, settings: GenerationSettings, past: Any) -> Any:
    """The reference sampler's final scores for one row (-inf where it never samples)."""
    procs = logits_processors(settings, PROMPT)
    return procs(past[None, :], logits[None, :].clone())[0] if len(procs) else logits.clone()


def ours(settings: GenerationSettings) -> RowSettings:
    return row_settings(settings)


@pytest.fixture(scope="module")
def batch() -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(32, VOCAB, generator=g) * 3
    prompt = torch.randint(0, VOCAB, (32, PROMPT), generator=g)
    top = logits.topk(3, dim=-1).indices  # the output so far repeats each row's likeliest tokens: penalties bite
    output = torch.cat([top.repeat(1, 3), torch.randint(0, VOCAB, (32, 4), generator=g)], dim=1)
    return logits, torch.cat([prompt, output], dim=1)


PENALISED = {
    "repetition_penalty": 1.4,
    "presence_penalty": 0.7,
    "frequency_penalty": 0.5,
    "logit_bias": {3: 5.0, 4: -100.0},
}


@pytest.mark.parametrize(
    "extra",
    [{}, PENALISED, {"repetition_penalty": 0.8}, {"frequency_penalty": 1.5}, {"presence_penalty": 2.0}],
    ids=["plain", "penalised", "rep<1", "frequency", "presence"],
)
def test_greedy_picks_the_reference_token_on_every_row(batch: tuple[Any, Any], extra: dict[str, Any]) -> None:
    logits, past = batch
    settings = GenerationSettings(temperature=0, **extra)
    want = [int(reference_scores(logits[i], settings, past[i]).argmax()) for i in range(len(logits))]
    got = BatchedSampler(VOCAB).sample(
        logits, [ours(settings)] * len(logits), [0] * len(logits), list(past), [PROMPT] * len(logits)
    )
    assert got.tolist() == want
    if extra and extra.get("repetition_penalty", 2.0) > 1.0:  # some rows' choice moved: a step left out would show
        assert want != logits.argmax(dim=-1).tolist()


SAMPLED = {
    "temperature 0.7": {"temperature": 0.7},
    "top_k 5": {"temperature": 1.0, "top_k": 5},
    "top_p 0.8": {"temperature": 1.0, "top_p": 0.8},
    "min_p 0.1, temperature 1.3": {"temperature": 1.3, "min_p": 0.1},
    "temperature 0.9, top_k 20, top_p 0.9": {"temperature": 0.9, "top_k": 20, "top_p": 0.9},
    "penalties and bias, temperature 1.0": {"temperature": 1.0, **PENALISED},
}


@pytest.mark.parametrize("name", list(SAMPLED))
def test_draws_follow_the_reference_distribution(batch: tuple[Any, Any], name: str) -> None:
    from scipy.stats import chisquare

    logits, past = batch
    row = logits[0] / 3  # std 1: every setting keeps several tokens
    settings = GenerationSettings(seed=7, **SAMPLED[name])
    probs = torch.softmax(reference_scores(row, settings, past[0]).double(), dim=-1)
    n = 4000
    draws = BatchedSampler(VOCAB).sample(
        row[None, :].expand(n, VOCAB), [ours(settings)] * n, list(range(n)), [past[0]] * n, [PROMPT] * n
    )
    counts = Counter(draws.tolist())
    assert all(probs[t] > 0 for t in counts), "drew a token the reference never samples"
    keep = [t for t in range(VOCAB) if probs[t] * n >= 5]
    rest = [t for t in range(VOCAB) if 0 < probs[t] * n < 5]
    observed = [counts[t] for t in keep] + ([sum(counts[t] for t in rest)] if rest else [])
    expected = [float(probs[t]) * n for t in keep] + ([float(sum(probs[t] for t in rest)) * n] if rest else [])
    assert len(observed) >= 4, f"{name}: too few tokens kept to test"
    scale = n / sum(expected)
    p = chisquare(observed, [e * scale for e in expected]).pvalue
    assert p > 0.001, f"{name}: chi-square p = {p:.2g} over {len(observed)} cells"


def test_a_jobs_draws_do_not_depend_on_its_neighbours(batch: tuple[Any, Any]) -> None:
    logits, past = batch
    s = [ours(GenerationSettings(temperature=1.0, seed=i)) for i in range(len(logits))]
    together = BatchedSampler(VOCAB).sample(logits, s, [3] * len(logits))
    alone = [int(BatchedSampler(VOCAB).sample(logits[i : i + 1], [s[i]], [3])[0]) for i in range(len(logits))]
    assert together.tolist() == alone
    again = BatchedSampler(VOCAB).sample(logits, s, [4] * len(logits))
    assert again.tolist() != together.tolist()  # the step counter moves the draw


def test_ids_past_the_vocabulary_are_never_sampled() -> None:
    logits = torch.zeros(64, 40)
    logits[:, 30:] = 50.0  # padding past a 30-token vocabulary, as exllamav3's logits may have
    got = BatchedSampler(30).sample(logits, [ours(GenerationSettings(temperature=1.0))] * 64, list(range(64)))
    assert int(got.max()) < 30


def test_settings_it_does_not_cover_are_named() -> None:
    assert uncovered(GenerationSettings(typical=0.9)) == "typical sampling"
    assert uncovered(GenerationSettings(no_repeat_ngram_size=3)) == "no_repeat_ngram_size"
    assert uncovered(GenerationSettings(temperature=0.5, top_p=0.9, repetition_penalty=1.1)) is None


# ---------------------------------------------------------------------- the rule, on a fake generator


class FakeJob:
    def __init__(self, **kw: Any) -> None:
        self.forced_ids = None
        self.new_tokens = 3
        self.sequences = [object()]
        self.device_logit_mask = None
        self.return_probs = False
        self.return_top_tokens = 0
        self.current_device_ids = None
        self.__dict__.update(kw)

    def is_prefill_done(self) -> bool:
        return True

    def receive_logits(self, logits: Any) -> Any:
        return ("exllamav3's own", None, None, None)


class FakeModel:
    def __init__(self, logits: Any) -> None:
        self.logits = logits

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.logits

    def prefetch_tokens(self, ids: list[int]) -> None:
        self.prefetched = ids


class FakeGenerator:
    """exllamav3's decode step in miniature: one forward, then each job's receive_logits on its rows."""

    def __init__(self, jobs: list[FakeJob], logits: Any) -> None:
        self.active_jobs, self.model = jobs, FakeModel(logits)
        self.pending_jobs: list[Any] = []
        self.cache = object()
        self.tokenizer = type("T", (), {"actual_vocab_size": logits.shape[-1]})()

    def iterate(self) -> list[Any]:
        results: list[Any] = []
        self.iterate_gen(results)
        return results

    def iterate_gen(self, results: list[Any], draft_tokens: Any = None) -> None:
        logits = self.model.forward(None, {})
        for i, job in enumerate(self.active_jobs):
            results.append(job.receive_logits(logits[i : i + 1]))


def test_the_rule_batches_covered_jobs_and_leaves_the_rest_to_exllamav3(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fast_decode, "stands_aside", lambda: None)
    logits = torch.randn(6, 1, 50)
    jobs = [
        FakeJob(),
        FakeJob(device_logit_mask=torch.zeros(1)),
        FakeJob(return_probs=True),
        FakeJob(new_tokens=0),
        FakeJob(forced_ids=torch.tensor([[1]])),
        FakeJob(),
    ]
    gen = FakeGenerator(jobs, logits)
    fast = fast_decode.FastDecode(gen)
    assert fast.active
    greedy = RowSettings(greedy=True)
    for job in jobs:
        fast.adopt(job, greedy, 4)
    results: list[Any] = []
    gen.iterate_gen(results)
    assert [int(r[0]) for r in (results[0], results[5])] == [int(logits[0, 0].argmax()), int(logits[5, 0].argmax())]
    assert all(r[0] == "exllamav3's own" for r in results[1:5])
    why = fast.report()["sampled_by_exllamav3"]
    assert set(why) == {
        "a grammar or token mask",
        "logprobs",
        "its first token (exllamav3 checks the logits are finite)",
        "a forced token",
    }
    gen.iterate_gen(results := [], draft_tokens=torch.zeros(6, 2))  # a drafted window: exllamav3 samples it all
    assert all(r[0] == "exllamav3's own" for r in results)
    assert fast.report()["batched_tokens"] == 2


def test_where_the_seam_stands_aside_nothing_is_hooked_and_close_still_works(monkeypatch: pytest.MonkeyPatch) -> None:
    why = "exllamav3 1.6.6 is not a verified release (verified: 1.6.5); its own loop runs"
    monkeypatch.setattr(fast_decode, "stands_aside", lambda: why)
    gen = FakeGenerator([FakeJob()], torch.randn(1, 1, 10))
    fast = fast_decode.FastDecode(gen, prefill=True, deterministic=True)
    assert not fast.active and fast.report() == {"decode": "exllamav3", "stands_aside": why}
    job = gen.active_jobs[0]
    fast.adopt(job, RowSettings(greedy=True), 1)
    assert not vars(gen).keys() & {"iterate", "iterate_gen"} and "forward" not in vars(gen.model)
    assert "receive_logits" not in vars(job)
    results: list[Any] = []
    gen.iterate_gen(results)
    assert results[0][0] == "exllamav3's own"
    fast.close()  # (it raised AttributeError here before: the model then stayed loaded)
    fast.close()


def test_close_removes_every_wrap_it_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fast_decode, "stands_aside", lambda: None)
    logits = torch.randn(2, 1, 50)
    jobs = [FakeJob(), FakeJob()]
    gen = KwargsGenerator(jobs, logits)
    own = (gen.iterate, gen.iterate_gen, gen.model.forward, gen.model.prefetch_tokens)
    fast = fast_decode.FastDecode(gen, graphs=False)
    for job in jobs:
        fast.adopt(job, RowSettings(greedy=True), 4)
    assert {"iterate", "iterate_gen"} <= vars(gen).keys() and "receive_logits" in vars(jobs[0])
    gen.iterate_gen(results := [])
    assert [int(r[0]) for r in results] == logits[:, 0].argmax(-1).tolist()
    fast.close()
    assert (gen.iterate, gen.iterate_gen, gen.model.forward, gen.model.prefetch_tokens) == own
    assert not any("receive_logits" in vars(j) for j in jobs)
    gen.iterate_gen(results := [])
    assert all(r[0] == "exllamav3's own" for r in results)  # exllamav3 alone again


class OwnGraphs:
    """DecodeGraphs as the fast path sees it on EXL3 weights: exllamav3's own graphs run steps of up to ``rows``."""

    def __init__(self, rows: int) -> None:
        self.rows, self.own_graphs_step = rows, False

    def forward(self, eager: Any, input_ids: Any, params: dict[str, Any]) -> Any:
        out = eager(input_ids, params)
        self.own_graphs_step = out.shape[0] <= self.rows
        return out

    def close(self) -> None:
        pass

    def report(self) -> dict[str, Any]:
        return {"captured": False}


class KwargsGenerator(FakeGenerator):
    def iterate_gen(self, results: list[Any], draft_tokens: Any = None) -> None:
        logits = self.model.forward(input_ids=torch.zeros(len(self.active_jobs), 1, dtype=torch.long), params={})
        for i, job in enumerate(self.active_jobs):
            results.append(job.receive_logits(logits[i : i + 1]))


@pytest.mark.parametrize(
    ("rows", "settings", "exllamav3_samples"),
    [
        (1, RowSettings(greedy=True), True),  # one greedy row, exllamav3's own graphs: its argmax, no wrappers
        (1, RowSettings(temperature=0.8, seed=3), False),  # a seeded draw stays ours whoever shares its batch
        (1, RowSettings(greedy=True, logit_bias=((2, 5.0),)), False),
        (2, RowSettings(greedy=True), False),  # two rows: one batched pass
    ],
)
def test_a_lone_greedy_job_on_exllamav3s_own_graphs_is_left_to_it(
    monkeypatch: pytest.MonkeyPatch, rows: int, settings: RowSettings, exllamav3_samples: bool
) -> None:
    monkeypatch.setattr(fast_decode, "stands_aside", lambda: None)
    logits = torch.randn(rows, 1, 50)
    jobs = [FakeJob() for _ in range(rows)]
    gen = KwargsGenerator(jobs, logits)
    fast = fast_decode.FastDecode(gen, graphs=False)
    fast.graphs = OwnGraphs(rows=8)  # type: ignore[assignment]
    for job in jobs:
        fast.adopt(job, settings, 4)
    results: list[Any] = []
    gen.iterate_gen(results)
    assert all((r[0] == "exllamav3's own") == exllamav3_samples for r in results)
    assert (fast_decode.LONE_GREEDY in fast.report()["sampled_by_exllamav3"]) == exllamav3_samples
    if not exllamav3_samples:
        assert fast.report()["batched_tokens"] == rows
        if settings.plain_greedy:
            assert [int(r[0]) for r in results] == logits[:, 0].argmax(-1).tolist()
    fast.graphs = OwnGraphs(rows=0)  # the same jobs on a step exllamav3 did not graph: the batched pass
    gen.iterate_gen(results := [])
    assert all(r[0] != "exllamav3's own" for r in results)


# ---------------------------------------------------------------------- the next step run ahead: when


class Seq:
    def __init__(self, pages: int) -> None:
        self.allocated_pages = [object()] * pages


class AheadJob(FakeJob):
    def __init__(self, **kw: Any) -> None:
        kw = {
            "sequences": [Seq(2)],
            "stop_tokens": {2},
            "max_new_tokens": 100,
            "max_rq_tokens": 1000,
            "rq_margin": 0,
            "return_logits": False,
            **kw,
        }
        super().__init__(**kw)
        self.prefilled = True

    def receive_logits(self, logits: Any) -> Any:
        return (torch.tensor([[7]]), None, None, None)  # exllamav3's own draw

    def is_prefill_done(self) -> bool:
        return self.prefilled


class Ahead(OwnGraphs):
    """DecodeGraphs as the fast path sees it on a captured step: what it was asked to run ahead."""

    ahead = True

    @property
    def can_launch(self) -> bool:
        return self.ahead

    def __init__(self) -> None:
        super().__init__(rows=0)
        self.launched: list[tuple[list[int], list[int]]] = []

    def launch_ahead(self, tokens: list[int], pages: list[int]) -> bool:
        self.launched.append((tokens, pages))
        return True


class PrefetchModel(FakeModel):
    def prefetch_tokens(self, ids: list[int]) -> None:
        self.prefetched = ids


class SyncingGenerator(KwargsGenerator):
    """A decode step as exllamav3 runs it: forward, each job's token, one synchronize, then ``prefetch_tokens``."""

    def __init__(self, jobs: list[FakeJob], logits: Any) -> None:
        super().__init__(jobs, logits)
        self.model = PrefetchModel(logits)
        self.pending_jobs: list[Any] = []

    def iterate_gen(self, results: list[Any], draft_tokens: Any = None) -> None:
        super().iterate_gen(results, draft_tokens)
        if draft_tokens is None:
            self.model.prefetch_tokens([int(r[0]) for r in results])


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({}, None),
        ({"pending_jobs": True}, "jobs waiting to start"),
        ({"prefilling": True}, "a job in prefill"),
        ({"stop_token": True}, "a job ends with this token"),
        ({"max_new_tokens": 4}, "a job ends with this token"),  # its 4th token is the last
        ({"max_rq_tokens": 3}, "a job ends with this token"),  # requeued after its 4th: a new job takes its place
        ({"return_logits": True}, "logits returned"),
        ({"sequences": [Seq(2), Seq(2)]}, "several sequences"),
    ],
)
def test_the_next_step_runs_ahead_only_when_its_rows_will_be_these(
    monkeypatch: pytest.MonkeyPatch, change: dict[str, Any], why: str | None
) -> None:
    monkeypatch.setattr(fast_decode, "stands_aside", lambda: None)
    logits = torch.randn(3, 1, 50)
    logits[:, 0, 2] = -1e9  # token 2 (the jobs' stop token) is nobody's argmax...
    jobs = [AheadJob(sequences=[Seq(2 + i)]) for i in range(3)]
    last = jobs[2]
    for k, v in change.items():
        if k == "pending_jobs":
            continue  # the generator's, below
        if k == "prefilling":
            last.prefilled = False
        elif k == "stop_token":
            logits[2, 0, 2] = 1e9  # ...but the last job's: it draws its stop token
        else:
            setattr(last, k, v)
    gen = SyncingGenerator(jobs, logits)
    if why == "jobs waiting to start":
        gen.pending_jobs.append(AheadJob())
    fast = fast_decode.FastDecode(gen, graphs=False)
    fast.graphs = graphs = Ahead()  # type: ignore[assignment]
    for job in jobs:
        fast.adopt(job, RowSettings(greedy=True), 4)
    results: list[Any] = []
    gen.iterate_gen(results)
    assert gen.model.prefetched == [int(r[0]) for r in results]  # exllamav3's own prefetch still runs
    if why is None:
        assert graphs.launched == [([int(r[0]) for r in results], [2, 3, 4])]
        assert fast.report()["not_run_ahead"] == {}
    else:
        assert graphs.launched == []
        assert fast.report()["not_run_ahead"] == {why: 1}
    gen.iterate_gen(results := [], draft_tokens=torch.zeros(3, 2))  # a drafted window is never run ahead
    assert len(graphs.launched) == (1 if why is None else 0)


def test_a_step_that_fails_to_run_ahead_turns_it_off_and_the_step_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fast_decode, "stands_aside", lambda: None)
    logits = torch.randn(2, 1, 50)
    logits[:, 0, 2] = -1e9  # nobody draws the stop token
    jobs = [AheadJob(), AheadJob()]
    gen = SyncingGenerator(jobs, logits)
    fast = fast_decode.FastDecode(gen, graphs=False)
    fast.graphs = graphs = Ahead()  # type: ignore[assignment]

    def broken(tokens: list[int], pages: list[int]) -> bool:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    graphs.launch_ahead = broken  # type: ignore[method-assign]
    for job in jobs:
        fast.adopt(job, RowSettings(greedy=True), 4)
    for _ in range(2):
        results: list[Any] = []
        gen.iterate_gen(results)
        assert [int(r[0]) for r in results] == logits[:, 0].argmax(-1).tolist()  # each step's tokens all the same
    assert graphs.ahead is False
    assert fast.report()["not_run_ahead"] == {"off: running ahead failed": 1}  # tried once, then off
