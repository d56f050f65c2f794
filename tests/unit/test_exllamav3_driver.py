"""The exllamav3 backend's own logic, without a GPU: its options, the inbox's burst window, and the driver.

The generator itself runs on the lent GPU (tests/gpu); here the :class:`Driver` runs a fake generator that
returns results shaped like exllamav3 1.6.5's ``iterate()`` output.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest

from exllama_integrations.backends import options_for
from exllama_integrations.backends.base import BackendRequest, TokenStep
from exllama_integrations.backends.exllamav3 import ExLlamaV3Backend
from exllama_integrations.backends.exllamav3.driver import Driver
from exllama_integrations.backends.exllamav3.translate import LiveJob
from exllama_integrations.backends.inbox import EXPECT_AT_MOST, Inbox
from exllama_integrations.contract.api import Reasoning
from exllama_integrations.contract.settings import GenerationSettings
from exllama_integrations.errors import InvalidSettingsError, ModelNotFoundError
from exllama_integrations.model.files import peft_adapter
from exllama_integrations.runtime.local.reasoning import ReasoningControl


def _options(**kw):
    return options_for(ExLlamaV3Backend, kw)


def test_lora_and_draft_options_are_checked_by_name():
    o = _options(lora_dir=["/a", "/b"], lora_scaling=[1.0, 0.5])
    assert o.lora_dirs == ["/a", "/b"] and o.lora_scalings == [1.0, 0.5]
    assert _options(lora_dir="/a", lora_scaling=0.5).lora_scalings == [0.5]
    with pytest.raises(InvalidSettingsError, match="lora_scaling has 1 values for 2"):
        _options(lora_dir=["/a", "/b"], lora_scaling=[1.0])
    with pytest.raises(InvalidSettingsError, match="choose one"):
        _options(draft_model_dir="/d", ngram_match_min=2)
    with pytest.raises(InvalidSettingsError, match="num_draft_tokens needs"):
        _options(num_draft_tokens=4)
    with pytest.raises(InvalidSettingsError, match="did you mean 'draft_model_dir'"):
        _options(draft_model=4)


def test_peft_adapter_is_checked_before_anything_loads(tmp_path):
    with pytest.raises(InvalidSettingsError, match="not a directory"):
        peft_adapter(tmp_path / "missing")
    with pytest.raises(InvalidSettingsError, match="needs adapter_config.json and adapter_model.safetensors"):
        peft_adapter(tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8}))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\x08")
    with pytest.raises(InvalidSettingsError, match="truncated"):
        peft_adapter(tmp_path)
    import numpy as np
    from safetensors.numpy import save_file

    save_file({"x": np.zeros(2, dtype=np.float16)}, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(InvalidSettingsError, match="lora_alpha"):
        peft_adapter(tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    config, weights = peft_adapter(tmp_path)
    assert config["r"] == 8 and weights.name == "adapter_model.safetensors"


def _driver(interval: int = 1, window: float = 0.0, generator=None, make_job=None) -> Driver:
    return Driver(
        generator if generator is not None else _Generator(),
        Inbox(window),
        make_job or (lambda req: (_Job(), False)),
        lambda req: "grammar-filter",
        interval=interval,
    )


def _live(steps: list[TokenStep]) -> LiveJob:
    s = GenerationSettings()
    req = BackendRequest([1], s, 16, frozenset({2}), steps.append)
    return LiveJob(object(), req)


class _Ids:
    def __init__(self, ids):
        self._ids = ids

    def flatten(self):
        return self

    def tolist(self):
        return list(self._ids)


def _result(entry: LiveJob, ids, **kw):
    return {"job": entry.job, "stage": "streaming", "token_ids": _Ids(ids), **kw}


def test_stream_interval_groups_steps_and_the_end_carries_what_was_held():
    b, steps = _driver(interval=3), []
    e = _live(steps)
    for t in (10, 11, 12, 13, 14):
        assert not b._deliver(_result(e, [t]), e, 3)  # the driver's bookkeeping of one job
    assert steps == [TokenStep((10,)), TokenStep((11, 12, 13))]  # the first token at once, then every 3 steps
    end = _result(e, [15], eos=True, eos_reason="stop_token", eos_triggering_token_id=2, held={"token_ids": _Ids([2])})
    assert b._deliver(end, e, 3)
    assert steps[-1] == TokenStep((14, 15, 2), None, "stop_token")  # held tokens, then the stop id, once
    b2, steps2 = _driver(interval=3), []
    e2 = _live(steps2)
    for t in (5, 6):
        b2._deliver(_result(e2, [t]), e2, 1)  # one job decoding alone: every step
    assert steps2 == [TokenStep((5,)), TokenStep((6,))]
    assert b2._deliver(_result(e2, [7], eos=True, eos_reason="max_new_tokens"), e2, 1)
    assert steps2[-1] == TokenStep((7,), None, "length")


def test_auto_interval_keeps_about_eight_readers_woken_per_step_and_stop_strings_are_watched_every_step():
    from exllama_integrations.backends.exllamav3.driver import delivery_interval

    assert [delivery_interval("auto", n) for n in (1, 8, 15, 16, 24, 64, 256)] == [1, 1, 1, 2, 3, 8, 32]
    assert [delivery_interval(4, n) for n in (1, 2, 64)] == [1, 4, 4]
    assert _options().stream_interval == "auto" and _options(stream_interval=8).stream_interval == 8
    for bad in (0, 65, "fast"):
        with pytest.raises(InvalidSettingsError, match="stream_interval"):
            _options(stream_interval=bad)
    b, steps = _driver(interval="auto"), []
    req = BackendRequest([1], GenerationSettings(stop=["END"]), 16, frozenset({2}), steps.append)
    e = LiveJob(object(), req)
    for t in (10, 11, 12):
        b._deliver(_result(e, [t]), e, 4)
    assert steps == [TokenStep((10,)), TokenStep((11,)), TokenStep((12,))]  # a stop string can end it at any token


def test_an_idle_driver_takes_a_burst_of_requests_at_once():
    box = Inbox(window=0.02)

    def burst():
        for i in range(5):
            box.put([i])
            time.sleep(0.005)  # callers a few ms apart, as threads of a LangChain batch are

    threading.Thread(target=burst).start()
    taken = box.take(idle=True)
    assert taken == [0, 1, 2, 3, 4]
    nb = Inbox(window=0.0)
    nb.put([0])
    assert len(nb.take(idle=True)) == 1  # no window: at once
    busy = Inbox(window=10.0)
    busy.put([0])
    t0 = time.monotonic()
    assert len(busy.take(idle=False)) == 1 and time.monotonic() - t0 < 1  # with jobs decoding: no wait
    assert busy.close() == [] and not busy.put([1])
    assert busy.take(idle=True) is None


def test_a_burst_whose_requests_come_further_apart_than_the_window_starts_together_and_a_lone_one_does_not_wait():
    lone = Inbox(window=0.002, burst_window=0.2)
    lone.put([0])
    t0 = time.monotonic()
    assert lone.take(idle=True) == [0] and time.monotonic() - t0 < 0.15  # the short window, not the burst's
    plain = Inbox(window=0.002)
    _arrivals(plain, [0, 1, 2, 3], 0.05)
    assert len(plain.take(idle=True)) < 4  # without a burst window a burst this spread starts in pieces
    box = Inbox(window=0.002, burst_window=0.2)
    box.put([0])
    _arrivals(box, [1, 2, 3], 0.012)
    assert box.take(idle=True) == [0, 1, 2, 3]


def _arrivals(box: Inbox, items: list, gap: float) -> None:
    def go():
        for i in items:
            box.put([i])
            time.sleep(gap)

    threading.Thread(target=go, daemon=True).start()


def test_an_announced_batch_is_waited_for_and_a_member_that_never_comes_is_not_waited_for_long(caplog):
    caplog.set_level(logging.DEBUG, logger=Inbox.__module__)
    alone = Inbox(window=0.002)
    _arrivals(alone, [0, 1, 2], 0.03)  # members 30 ms apart: more than the quiet window
    assert alone.take(idle=True) == [0]
    box = Inbox(window=0.002)
    box.expect(3)
    _arrivals(box, [0, 1, 2], 0.03)
    assert box.take(idle=True) == [0, 1, 2]  # told they were coming: all three prefill together
    late = Inbox(window=0.002)
    late.expect(5)
    t0 = time.monotonic()
    _arrivals(late, [0], 0)
    assert late.take(idle=True) == [0]  # four never came (failed before submit): not waited for forever
    assert 0.5 * EXPECT_AT_MOST < time.monotonic() - t0 < 2 and late._expected == 0
    waits = [r for r in caplog.records if hasattr(r, "inbox_missing")]  # the debug log says how each batch started
    assert [r.inbox_missing for r in waits] == [0, 4]
    assert waits[0].inbox_wait_s < waits[1].inbox_wait_s and "1 requests start together" in waits[1].getMessage()


def test_an_announced_batch_that_is_all_in_starts_at_once_and_the_next_request_waits_for_quiet_again():
    box = Inbox(window=0.4)  # a long quiet window: waiting for it would show
    box.expect(3)
    t0 = time.monotonic()

    def members():
        box.put([0, 1])  # handed in whole or in pieces: once the last member is in, the batch is complete
        time.sleep(0.01)
        box.put([2])

    threading.Thread(target=members, daemon=True).start()
    assert box.take(idle=True) == [0, 1, 2] and time.monotonic() - t0 < 0.3
    box.put([3])  # not announced: an idle driver waits for quiet (a burst may be arriving)
    t0 = time.monotonic()
    assert box.take(idle=True) == [3] and time.monotonic() - t0 >= 0.35


class _Job:
    """exllamav3's Job as the driver steers it: forced output, filters replaced."""

    def __init__(self):
        self.forced_ids, self.filters, self.forced = None, [], []

    def constrain_output_now(self, ids):
        self.forced.append([int(t) for t in ids.flatten().tolist()])
        self.forced_ids = ids

    def set_filters(self, filters):
        assert self.forced_ids is None, "exllamav3 refuses new filters while forced output drains"
        self.filters = list(filters)


class _Generator:
    """exllamav3's Generator as the driver sees it: jobs in, one token per job per iterate(), done after ``n``."""

    def __init__(self, n: int = 2, tokens=None):
        self.jobs, self.closed, self.n, self.tokens = [], False, n, tokens

    def enqueue(self, job):
        self.jobs.append([job, 0])

    def cancel(self, job):
        self.jobs = [j for j in self.jobs if j[0] is not job]

    def iterate(self):
        out = []
        for j in self.jobs:
            j[1] += 1
            job = j[0]
            if getattr(job, "forced_ids", None) is not None:  # a forced token is written as it is
                tok, rest = int(job.forced_ids[0, 0]), job.forced_ids[:, 1:]
                job.forced_ids = rest if rest.shape[-1] else None
            else:
                tok = self.tokens[j[1] - 1] if self.tokens else j[1]
            out.append({"job": job, "stage": "streaming", "token_ids": _Ids([tok]), "eos": j[1] == self.n})
            if j[1] == self.n:
                out[-1].update(eos_reason="max_new_tokens", cached_tokens=3)
        self.jobs = [j for j in self.jobs if j[1] < self.n]
        return out

    def close(self):
        self.closed = True


def test_the_driver_builds_each_job_and_a_bad_request_fails_alone():
    built = []

    def job(req):  # on the driver's thread, not the caller's
        built.append(threading.current_thread().name)
        if req.prompt_ids == [666]:
            raise ValueError("no such job")
        return _Job(), False

    d = _driver(make_job=job)
    d.start()
    steps: dict[int, list[TokenStep]] = {1: [], 666: [], 3: []}
    reqs = [BackendRequest([k], GenerationSettings(), 2, frozenset(), steps[k].append) for k in steps]
    assert d.inbox.put(reqs)
    deadline = time.monotonic() + 10
    while not all(v and v[-1].finish for v in steps.values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    d.stop()
    assert built == ["exllama-exllamav3-driver"] * 3
    assert isinstance(steps[666][-1].error, ValueError) and steps[666][-1].finish == "error"
    for k in (1, 3):
        assert [t for st in steps[k] for t in st.token_ids] == [1, 2] and steps[k][-1].finish == "length"
        assert steps[k][-1].cached == 3  # exllamav3's reused prompt tokens reach the usage
    assert not d.inbox.put([BackendRequest([1], GenerationSettings(), 2, frozenset(), steps[1].append)])
    assert d.live == 0


class _CachedJob(_Job):
    """A Job whose pages came partly from the prefix cache, as exllamav3 1.6.5 counts them when it allocates."""

    def __init__(self, pages: int, tokens: int, requeued=None):
        super().__init__()
        self.cached_pages, self.cached_tokens, self.sequences, self.rq_cached = pages, tokens, [object()], requeued


def test_the_first_step_says_how_much_of_the_prompt_came_from_the_cache():
    """exllamav3 reports reused prompt tokens in a job's last result only; the first token's step says it too."""
    jobs = iter([_CachedJob(2, 40), _CachedJob(0, 0), _CachedJob(1, 0, requeued=(3, 800))])
    d = _driver(generator=_Generator(n=3), make_job=lambda req: (next(jobs), False))
    d.start()
    steps: dict[int, list[TokenStep]] = {1: [], 2: [], 3: []}
    for k in steps:  # one at a time: the jobs are built in this order
        assert d.inbox.put([BackendRequest([k], GenerationSettings(), 3, frozenset(), steps[k].append)])
        deadline = time.monotonic() + 10
        while not (steps[k] and steps[k][-1].finish) and time.monotonic() < deadline:
            time.sleep(0.01)
    d.stop()
    said = {k: [s.cached for s in v] for k, v in steps.items()}
    assert said == {1: [552, None, 3], 2: [0, None, 3], 3: [800, None, 3]}, said  # 2 pages of 256 and 40 tokens


def _pieces(tid: int) -> str:
    return {7: "</think>", 8: "<", 9: "/think", 10: ">"}.get(tid, "x")


def test_the_driver_writes_the_end_of_thinking_when_the_budget_is_spent_and_then_attaches_the_grammar():
    """The request's reasoning control sees every step; a spent budget becomes exllamav3's forced output, and the
    grammar (which forcing turned off) is attached once the forced tokens are written."""
    steer = ReasoningControl(Reasoning(started=True, budget=3), _pieces, [8, 9, 10])
    job = _Job()
    gen = _Generator(n=8)
    d = _driver(generator=gen, make_job=lambda req: (job, False))
    steps: list[TokenStep] = []
    req = BackendRequest([1], GenerationSettings(), 8, frozenset(), steps.append, constraint=object(), steering=steer)
    d.start()
    d.inbox.put([req])
    deadline = time.monotonic() + 10
    while not (steps and steps[-1].finish) and time.monotonic() < deadline:
        time.sleep(0.01)
    d.stop()
    tokens = [t for st in steps for t in st.token_ids]
    assert job.forced == [[8, 9, 10]]  # once, after three thinking tokens
    assert tokens[3:6] == [8, 9, 10] and steer.reasoning_tokens == 6 and steer.constrained
    assert job.filters == ["grammar-filter"]  # the answer is held to the grammar


def test_a_runtime_with_a_lora_is_its_own_shared_entry():
    """Adapters apply to every job of a runtime, so the shared registry keys them apart."""
    plain, adapted = _options(), _options(lora_dir="/adapters/a")
    assert plain.key() != adapted.key() != _options(lora_dir="/adapters/a", lora_scaling=0.5).key()
    assert _options(draft_model_dir="/d").key() != plain.key()


def test_a_draft_model_is_checked_against_the_main_model_before_loading(tmp_path):
    from exllama_integrations.backends.exllamav3.extras import inspect_draft
    from exllama_integrations.model.directory import ModelDirectory

    from fixture_models import Shape, make_llama

    small = Shape(hidden=64, layers=1, heads=2, kv_heads=1, inter=128, vocab=512)
    main = ModelDirectory.inspect(make_llama(tmp_path / "main", small, device="cpu"))
    same = make_llama(tmp_path / "same", small, seed=1, device="cpu")
    other = make_llama(
        tmp_path / "other", Shape(hidden=64, layers=1, heads=2, kv_heads=1, inter=128, vocab=600), device="cpu"
    )
    assert inspect_draft(_options(), main) is None
    assert inspect_draft(_options(draft_model_dir=str(same)), main).name == "same"
    with pytest.raises(InvalidSettingsError, match="vocabulary of 600 tokens .* 512; a draft model must share"):
        inspect_draft(_options(draft_model_dir=str(other)), main)
    with pytest.raises(ModelNotFoundError, match="draft_model_dir: model directory .* does not exist"):
        inspect_draft(_options(draft_model_dir=str(tmp_path / "nowhere")), main)
