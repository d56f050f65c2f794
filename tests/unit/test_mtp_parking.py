"""An MTP drafter parked on the steps that draft nothing, and caught up before it drafts again.

The generator here is exllamav3's (1.6.5) as parking relies on it (the rules ``upstream/requirements.py`` declares
for ``mtp_parking.py``): with a drafter attached every step's target forward hands each decoding job a carry at its
position and a prompt is prefilled into the head's cache; without one (parked) neither happens; a drafted step drafts
from every job's carry (none missing), and the last result carries the drafted counts only while a drafter is
attached. It refuses to draft from a stale carry, the mistake parking must never make. The speed of a parked step is
measured on the GPU (benchmarks/gpu_mtp.py ``--jobs 16,64``; tests/gpu/test_gpu_mtp.py checks greedy tokens).
"""

from __future__ import annotations

import time

import torch

from exllama_integrations.backends.base import BackendRequest, TokenStep
from exllama_integrations.backends.exllamav3.driver import Driver
from exllama_integrations.backends.exllamav3.mtp_parking import CATCH_UP, DRAFTING, PARKED, MtpParking, Step
from exllama_integrations.backends.exllamav3.translate import DraftCounts
from exllama_integrations.backends.inbox import Inbox
from exllama_integrations.contract.settings import GenerationSettings


class Job:
    forced_ids = None

    def __init__(self) -> None:
        self.new_tokens = 0
        self.mtp_last_hidden: int | None = None  # the position the carry stands at
        self.accepted_draft_tokens = self.rejected_draft_tokens = 0


class MtpGenerator:
    """exllamav3's Generator with an MTP drafter, as parking relies on it (see the module docstring)."""

    def __init__(self, n: int, step_s: float = 0.0) -> None:
        self.draft_model, self.mtp_draft, self.num_draft_tokens = "the MTP head", True, 4
        self.n, self.step_s = n, step_s
        self.pending: list[Job] = []
        self.active: list[Job] = []
        self.log: list[tuple[bool, int]] = []  # per iterate: drafter attached, tokens drafted per row
        self.head_prefills = 0

    def enqueue(self, job: Job) -> None:
        self.pending.append(job)

    def cancel(self, job: Job) -> None:
        self.active = [j for j in self.active if j is not job]

    def iterate(self) -> list[dict]:
        attached = self.draft_model is not None
        assert attached == self.mtp_draft
        for job in self.pending:  # prefilled: the carry (and the head's cache) only with a drafter attached
            job.mtp_last_hidden = 0 if attached else None
            self.head_prefills += attached
        self.active += self.pending
        self.pending = []
        window = self.num_draft_tokens if attached else 0  # row_limited(): no drafter, no window
        if window and all(j.mtp_last_hidden is not None for j in self.active):
            stale = [(j.mtp_last_hidden, j.new_tokens) for j in self.active if j.mtp_last_hidden != j.new_tokens]
            assert not stale, f"drafted from a stale carry: {stale}"
        else:
            window = 0
        self.log.append((attached, window))
        time.sleep(self.step_s)
        out = []
        for job in self.active:
            k = min(1 + window, self.n - job.new_tokens)
            ids = torch.arange(job.new_tokens, job.new_tokens + k).view(1, -1)
            job.accepted_draft_tokens += k - 1
            job.rejected_draft_tokens += window - (k - 1)
            job.new_tokens += k
            if attached:
                job.mtp_last_hidden = job.new_tokens
            r = {"job": job, "stage": "streaming", "eos": job.new_tokens >= self.n, "token_ids": ids}
            if r["eos"]:
                r["eos_reason"] = "max_new_tokens"
                if attached:
                    r.update(
                        accepted_draft_tokens=job.accepted_draft_tokens, rejected_draft_tokens=job.rejected_draft_tokens
                    )
            out.append(r)
        self.active = [j for j in self.active if j.new_tokens < self.n]
        return out


class Scripted:
    """A rule that chooses the windows it is given, one a step, and keeps what it is told."""

    def __init__(self, windows: list[int]) -> None:
        self.windows, self.measures, self.catch_ups = list(windows), [], 0

    def window(self, rows: int) -> int:
        return self.windows.pop(0) if self.windows else 0

    def measured(self, rows: int, window: int, tokens: int, seconds: float) -> None:
        self.measures.append((window, tokens))

    def caught_up(self, rows: int, tokens: int, seconds: float) -> None:
        self.catch_ups += 1


def _drive(gen: MtpGenerator, rule, prompts: int = 1) -> tuple[list[list[TokenStep]], MtpParking, DraftCounts]:
    parking, drafts = MtpParking(gen), DraftCounts("MTP heads", 4)
    d = Driver(gen, Inbox(0.0), lambda req: (Job(), False), lambda req: None, drafts=drafts, draft_rule=rule,
               parking=parking)  # fmt: skip
    d.start()
    steps: list[list[TokenStep]] = [[] for _ in range(prompts)]
    assert d.inbox.put([BackendRequest([1], GenerationSettings(), gen.n, frozenset(), s.append) for s in steps])
    deadline = time.monotonic() + 10
    while not all(s and s[-1].finish for s in steps) and time.monotonic() < deadline:
        time.sleep(0.005)
    d.stop()
    return steps, parking, drafts


def test_a_step_that_drafts_nothing_runs_without_the_drafter_and_drafting_resumes_from_a_fresh_carry():
    rule = Scripted([0, 0, 0, 2, 2, 2, 0, 0, 3, 3, 0, 1])
    gen = MtpGenerator(n=40)
    steps, parking, drafts = _drive(gen, rule, prompts=2)
    for s in steps:
        assert [t for st in s for t in st.token_ids] == list(range(40))  # every token, parked or not
    # window 0: the drafter detached for the whole iterate(), so the step costs what a plain step costs
    assert gen.log[:3] == [(False, 0)] * 3
    # back to drafting: one attached step drafting nothing (every job's carry at its position), then the window
    assert gen.log[3:7] == [(True, 0), (True, 2), (True, 2), (True, 2)]  # (the window chosen with the catch-up, then 2)
    assert gen.log[7:12] == [(False, 0), (False, 0), (True, 0), (True, 3), (True, 3)]
    assert gen.head_prefills == 0  # both prompts were admitted on a parked step: nothing prefilled into the head
    kinds = [("parked" if not a else "drafting" if w else "catch_up") for a, w in gen.log]
    assert parking.report() == {f"{k}_steps": kinds.count(k) for k in ("parked", "catch_up", "drafting")}
    # the rule is told a catch-up is one (its cost), and each window's measure is a step that ran it
    assert rule.catch_ups >= 2 and all(w == 0 or tokens == 2 * (1 + w) for w, tokens in rule.measures)


def test_a_request_that_ends_on_a_parked_step_keeps_its_drafted_counts():
    rule = Scripted([2] * 5 + [0] * 100)  # drafts, then the rule parks the drafter until the end
    steps, _, drafts = _drive(MtpGenerator(n=30), rule)
    # (exllamav3 leaves the counts out of a result when the generator has no drafter: they would be lost)
    assert steps[0][-1].drafted == (2 * 5, 0)  # five steps drafted 2 tokens each, all accepted
    assert drafts.report()["accepted_draft_tokens"] == 10 and drafts.report()["jobs"] == 1


def test_the_plan_keeps_the_window_chosen_for_the_step_after_a_catch_up():
    parking = MtpParking(MtpGenerator(n=1))
    asked: list[int] = []

    def choose(rows: int) -> int:
        asked.append(rows)
        return [3, 0][len(asked) - 1]

    parking.parked = True
    assert parking.plan(16, choose) == Step(CATCH_UP, 3)
    parking.parked = False  # (run() ran the catch-up)
    assert parking.plan(17, choose) == Step(DRAFTING, 3) and asked == [16]  # the same bucket: not asked again
    parking.parked = True
    assert parking.plan(16, lambda r: 2) == Step(CATCH_UP, 2)
    assert parking.plan(40, choose) == Step(PARKED, 0)  # another bucket: its own window
