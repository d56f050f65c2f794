"""The draft window of each step, chosen from what the steps measured: drafting never makes a batch slower.

:class:`DraftRule` alone on given measures (which window runs, and when it changes), and the exllamav3 driver using it
with a fake generator that emits one more token per row for each token drafted (the driver sets the window before
each ``iterate()`` and hands the step's tokens back). The rule's speed on real steps is measured on the GPU
(benchmarks/gpu_mtp.py ``--jobs``).
"""

from __future__ import annotations

import time
from pathlib import Path

from exllama_integrations.backends.base import BackendRequest, TokenStep
from exllama_integrations.backends.exllamav3.draft_rule import DraftRule, bucket, decoding_only
from exllama_integrations.backends.exllamav3.driver import Driver
from exllama_integrations.backends.exllamav3.translate import DraftCounts
from exllama_integrations.backends.inbox import Inbox
from exllama_integrations.contract.settings import GenerationSettings


def _run(rule: DraftRule, rows: int, rate: dict[int, float], steps: int) -> list[int]:
    """``steps`` steps of ``rows`` rows where window ``k`` gives ``rate[k]`` tokens per second: the windows run."""
    chosen = []
    for _ in range(steps):
        k = rule.window(rows)
        chosen.append(k)
        rule.measured(rows, k, tokens=int(rate[k]), seconds=1.0)
    return chosen


def test_every_window_is_measured_first_then_the_fastest_runs():
    rule = DraftRule(max_window=4, warmup=2, explore_every=1000, settle=0)
    rate = {0: 1000.0, 1: 1500.0, 2: 1900.0, 3: 2200.0, 4: 2100.0}  # one stream, high acceptance: 3 is best
    chosen = _run(rule, 1, rate, 40)
    assert chosen[:10] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert set(chosen[10:]) == {3}
    assert rule.report()["1 rows"]["window"] == 3


def test_a_batch_where_drafting_costs_more_than_it_gives_drafts_nothing():
    rule = DraftRule(max_window=4, warmup=2, explore_every=1000, settle=0)
    rate = {0: 6400.0, 1: 5600.0, 2: 5000.0, 3: 4500.0, 4: 4100.0}  # 64 rows, GPU-bound: every drafted token loses
    chosen = _run(rule, 64, rate, 40)
    # one drafted token lost to none: the longer windows (a 64-row step drafting 4 verifies 320 positions) are not
    # tried at all, so the batch pays for 2 steps of window 1, not for 8 more of windows 2-4
    assert chosen[:4] == [0, 0, 1, 1] and set(chosen[4:]) == {0}
    # a bucket of its own: what one stream measured does not decide for 64 rows, nor the other way round
    assert bucket(64) == bucket(100) == 64 and bucket(1) == 1 and bucket(3) == 2
    assert _run(rule, 1, {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0, 4: 5.0}, 12)[:2] == [0, 0]


def test_a_window_is_tried_while_the_one_before_still_gained_and_reached_later_by_exploration():
    rule = DraftRule(max_window=4, warmup=1, explore_every=8, settle=0)
    chosen = _run(rule, 4, {0: 100.0, 1: 90.0, 2: 80.0, 3: 70.0, 4: 60.0}, 40)  # drafting loses at this load
    assert chosen[:2] == [0, 1] and set(chosen) == {0, 1}  # windows 2-4 never tried: 1 lost to 0
    # acceptance rose (or the batch shrank): the neighbour explored every 8 steps wins, then its neighbour
    chosen = _run(rule, 4, {0: 100.0, 1: 150.0, 2: 200.0, 3: 190.0, 4: 150.0}, 80)
    assert chosen[-20:].count(2) >= 17


def test_a_windows_first_steps_in_a_bucket_are_its_warm_up_not_its_rate():
    rule = DraftRule(max_window=1, warmup=2, explore_every=1000, settle=3)
    cold = {0: 100.0, 1: 20.0}  # window 1's first steps: exllamav3 runs the new shape eagerly, then captures it
    warm = {0: 100.0, 1: 180.0}
    chosen = []
    for _ in range(40):
        k = rule.window(1)
        chosen.append(k)
        arm_steps = chosen.count(k)
        rule.measured(1, k, tokens=int((cold if arm_steps <= 3 else warm)[k]), seconds=1.0)
    assert chosen[:10] == [0] * 5 + [1] * 5  # each arm: 3 settling steps, then 2 measured
    assert set(chosen[10:]) == {1} and rule.report()["1 rows"]["tok_s"] == {0: 100.0, 1: 180.0}


def test_exploring_costs_at_most_its_share_of_the_time_counting_the_catch_up():
    # 16 rows on an H100 (benchmarks/results/gpu_mtp_run3_h100.json): a parked step 16 tokens in 7.9 ms, a step
    # drafting 1 token 31 tokens in 43 ms (at a third of the rate, but twice the tokens: 4.4 steps' time lost, not
    # the 1.8 the rates say), and the catch-up before it (the drafter back after parked steps) 16 tokens in 9 ms
    from exllama_integrations.backends.exllamav3.mtp_parking import CATCH_UP, MtpParking

    class _Gen:
        draft_model, mtp_draft, num_draft_tokens = "head", True, 4

    timed = {0: (16, 0.0079), 1: (31, 0.043), 2: (45, 0.08), 3: (58, 0.12), 4: (70, 0.16)}
    rule = DraftRule(max_window=4, warmup=2, explore_every=32, settle=3, explore_share=0.01)
    parking = MtpParking(_Gen())
    total = lost = 0.0
    warm = None
    for i in range(20000):
        step = parking.plan(16, rule.window)
        tokens, seconds = (16, 0.009) if step.kind == CATCH_UP else timed[step.window]
        if step.kind == CATCH_UP:
            rule.caught_up(16, tokens, seconds)
        else:
            rule.measured(16, step.window, tokens, seconds)
        parking.parked = step.window == 0 and step.kind != CATCH_UP
        if warm is None and rule.report()["16 rows"]["steps"].get(1, 0) >= 5:
            warm = i  # window 1's warm-up (3 settling steps, 2 measured) is over: from here on it is exploring
        elif warm is not None:
            total += seconds
            lost += max(0.0, seconds - tokens / (16 / 0.0079))
    assert rule.report()["16 rows"]["window"] == 0
    assert (
        lost / total <= 0.011
    )  # what exploring cost, the catch-ups included, over the time (the rule before: 0.019, by rates)
    assert 0.005 <= rule.report()["16 rows"]["exploring_share"] <= 0.011  # what the rule counted: the same
    assert rule.report()["16 rows"]["catch_up_steps"] >= 5  # it still explored, every ~600 steps
    # a neighbour that costs little is explored every 32 steps
    near = _run(DraftRule(max_window=4, warmup=2, explore_every=32, settle=0), 16, {0: 1000.0, 1: 990.0}, 400)
    assert near[4:].count(1) >= 400 // 33 - 2


def test_a_larger_batch_starts_without_drafting_where_a_smaller_one_measured_it_losing():
    rule = DraftRule(max_window=4, warmup=2, explore_every=32, settle=0)
    _run(rule, 16, {0: 2000.0, 1: 700.0, 2: 600.0, 3: 500.0, 4: 400.0}, 10)  # 16 rows: a drafted token loses
    assert set(_run(rule, 64, {0: 5000.0, 1: 1000.0, 2: 900.0, 3: 800.0, 4: 700.0}, 30)) == {0}
    one = DraftRule(max_window=4, warmup=2, explore_every=32, settle=0)
    _run(one, 1, {0: 70.0, 1: 120.0, 2: 160.0, 3: 180.0, 4: 190.0}, 12)  # one stream: drafting wins
    assert _run(one, 2, {0: 130.0, 1: 220.0, 2: 300.0, 3: 340.0, 4: 350.0}, 4) == [0, 0, 1, 1]  # measured again


def test_the_choice_moves_when_what_a_window_gives_changes():
    rule = DraftRule(max_window=2, warmup=1, explore_every=4, settle=0)
    _run(rule, 8, {0: 100.0, 1: 150.0, 2: 200.0}, 12)
    assert rule.report()["8 rows"]["window"] in (1, 2)
    chosen = _run(rule, 8, {0: 300.0, 1: 150.0, 2: 100.0}, 120)  # acceptance fell: no drafting is best now
    assert chosen[-20:].count(0) >= 15


def test_only_a_step_of_decoding_alone_is_measured():
    assert decoding_only([{"stage": "streaming", "token_ids": None}, {"stage": "streaming"}])
    assert not decoding_only([{"stage": "streaming"}, {"stage": "prefill"}])
    assert not decoding_only([])


class _DraftingGenerator:
    """exllamav3's Generator as the driver sees it while drafting: each row advances 1 + num_draft_tokens tokens a step,
    and emits them only every third step (as exllamav3 holds tokens back while their text ends in a partial
    character)."""

    def __init__(self, n: int) -> None:
        self.jobs: list[list] = []
        self.n, self.num_draft_tokens, self.windows = n, 4, []

    def enqueue(self, job):
        self.jobs.append([job, 0])

    def cancel(self, job):
        self.jobs = [j for j in self.jobs if j[0] is not job]

    def iterate(self):
        import torch

        self.windows.append(self.num_draft_tokens)
        time.sleep(0.003)  # a step's time, much larger than its noise: each window gives (1 + window) tokens in it
        out = []
        for j in self.jobs:
            k = min(1 + self.num_draft_tokens, self.n - j[1])
            j[1] += k
            j[0].new_tokens += k
            end = j[1] >= self.n
            emit = end or len(self.windows) % 3 == 0
            ids = torch.arange(j[0].emitted, j[1]).view(1, -1) if emit else None
            j[0].emitted = j[1] if emit else j[0].emitted
            out.append({"job": j[0], "stage": "streaming", "eos": end, **({"token_ids": ids} if emit else {})})
            if j[1] >= self.n:  # exllamav3's counts of the finished job: every drafted position one or the other
                out[-1].update(eos_reason="max_new_tokens", accepted_draft_tokens=j[1] // 2, rejected_draft_tokens=7)
        self.jobs = [j for j in self.jobs if j[1] < self.n]
        return out


def test_the_driver_sets_each_steps_window_and_measures_it():
    class Job:
        forced_ids = None

        def __init__(self) -> None:
            self.new_tokens = self.emitted = 0

    gen = _DraftingGenerator(n=200)
    rule = DraftRule(max_window=4, warmup=2, explore_every=1000, settle=0)
    drafts = DraftCounts("MTP heads", 4)
    d = Driver(gen, Inbox(0.0), lambda req: (Job(), False), lambda req: None, drafts=drafts, draft_rule=rule)
    d.start()
    steps: list[TokenStep] = []
    assert d.inbox.put([BackendRequest([1], GenerationSettings(), 200, frozenset(), steps.append)])
    deadline = time.monotonic() + 10
    while not (steps and steps[-1].finish) and time.monotonic() < deadline:
        time.sleep(0.01)
    d.stop()
    assert [t for s in steps for t in s.token_ids] == list(range(200))  # every token, whatever the windows
    # the request's own drafted tokens on its last step (its usage), and in the model's counts
    assert steps[-1].drafted == (100, 7) and all(s.drafted is None for s in steps[:-1])
    assert drafts.report()["accepted_draft_tokens"] == 100
    # the rule's choice reached the generator; the first step read the prompt, so its measure did not count
    assert gen.windows[:11] == [0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    measured = rule.report()["1 rows"]["steps"]
    assert sum(measured.values()) == len(gen.windows) - 1
    # each window's rate is what the row advanced in a step (1 + window tokens in ~3 ms), not what it emitted
    rates = rule.report()["1 rows"]["tok_s"]
    assert all(rates[k] > 0.5 * (1 + k) / 0.003 for k in rates) and rates[4] > rates[0]


def test_the_defaults_are_what_docs_speculative_says():
    from exllama_integrations.backends import options_for
    from exllama_integrations.backends.exllamav3 import ExLlamaV3Backend

    rule = DraftRule(max_window=4)
    assert (rule.settle, rule.warmup, rule.explore_every) == (3, 2, 32)
    assert options_for(ExLlamaV3Backend, {"draft": "mtp"}).draft_window == "fixed"  # until the GPU has measured it
    page = (Path(__file__).resolve().parents[2] / "docs" / "speculative.md").read_text()
    assert "first 3 steps" in page and "2 more" in page and "at most once every 32" in page
    assert (rule.explore_every, rule.explore_share) == (32, 0.01) and "at most 1% of the bucket's measured time" in page
    assert '`diagnostics()["mtp_parking"].report()`' in page  # (tests/unit/test_mtp_parking.py: what it counts)
