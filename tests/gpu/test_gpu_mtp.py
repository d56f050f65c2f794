"""``draft="mtp"`` on exllamav3: greedy tokens identical with and without drafting, at known acceptance.

The checkpoints (tests/mtp_models.py, ``GPU_TEST``: a small Qwen3.5 shape, fp16) count upward: every layer's output
projections are zero and the LM head maps token ``t`` to ``t + 1``. Their MTP head drafts every token right
("perfect"), or is perturbed so that 70% of the drafts of ``PROMPT``'s job are accepted ("mix"); a third copy lacks
the head's weights (config.json still names one, as a quantization that dropped it) and is refused before loading.
With ``draft_window="measured"`` the drafter is parked on the steps that draft nothing and caught up before the next
drafted window (backends/exllamav3/mtp_parking.py): a scripted cycle of windows switches it off and back on
mid-generation at 1 and 16 jobs, and the tokens must be those of a runtime without a drafter.

Run on the lent GPU: ``pytest -m gpu tests/gpu/test_gpu_mtp.py -v -s``. Skipped without CUDA.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from mtp_models import GPU_TEST, Probe, calibrate, make_trunk, make_variant, window_acceptance

pytestmark = pytest.mark.gpu
PROMPT = "the quick brown fox jumps over the lazy dog"
NEW, WINDOW = 96, 4
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW, "ignore_eos": True}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tokenizers import Tokenizer

    root = tmp_path_factory.mktemp("mtp")
    trunk = make_trunk(root / "trunk", GPU_TEST, device="cuda")
    start = Tokenizer.from_file(str(trunk / "tokenizer.json")).encode(PROMPT).ids[-1]
    sigma, rate = calibrate(Probe(trunk, GPU_TEST, device="cuda"), start, NEW, WINDOW, target=0.7)
    accepted, rejected = window_acceptance(lambda t: True, start, NEW, WINDOW)
    return {
        "perfect": make_variant(trunk, root / "perfect", GPU_TEST, 0.0, device="cuda"),
        "mix": make_variant(trunk, root / "mix", GPU_TEST, sigma, device="cuda"),
        "none": make_variant(trunk, root / "none", GPU_TEST, None, device="cuda"),
        "start": start,
        "predicted": {"perfect": accepted / (accepted + rejected), "mix": rate},
    }


@pytest.mark.parametrize("level", ["perfect", "mix"])
def test_mtp_drafting_is_greedy_identical_and_reports_its_acceptance(checkpoints: dict[str, Any], level: str) -> None:
    from exllama_integrations import ExLlamaRuntime

    model: Path = checkpoints[level]
    prompts = [PROMPT, "a b c a b c a b c", "one two three four", "the lazy dog sleeps"]
    plain = ExLlamaRuntime(model, "exllamav3", cache_size=4096)
    try:
        t0 = time.perf_counter()
        results = [plain.generate(p, **GREEDY) for p in prompts]
        want = [list(r.token_ids) for r in results]
        t_plain = time.perf_counter() - t0
    finally:
        plain.close()
    # The runtime alone: what every door (LangChain, LlamaIndex, the server) drafts through, with no framework needed
    # the window fixed, as exllamav3 drafts: its acceptance is what the checkpoint predicts
    rt = ExLlamaRuntime(model, "exllamav3", cache_size=4096, draft="mtp", num_draft_tokens=WINDOW, draft_window="fixed")
    try:
        details = rt.model_info().details
        first_result = rt.generate(PROMPT, **GREEDY)
        first = list(first_result.token_ids)
        alone = rt.diagnostics()["drafting"].report()  # PROMPT's job: the one whose acceptance was predicted
        usage = first_result.usage  # the request's own counts: what the model-wide report added for it
        t0 = time.perf_counter()
        got = [list(rt.generate(p, **GREEDY).token_ids) for p in prompts]
        t_mtp = time.perf_counter() - t0
        with ThreadPoolExecutor(4) as ex:  # dynamic batching: four jobs drafting together
            together = [list(r.token_ids) for r in ex.map(lambda p: rt.generate(p, **GREEDY), prompts)]
        streamed = "".join(c.text for c in rt.stream(PROMPT, **GREEDY))
        report = rt.diagnostics()["drafting"].report()
        fast = rt.diagnostics()["fast_decode"].report()
        print(
            f"MTP drafting ({level}): 4 prompts x {NEW} greedy tokens in {t_mtp:.2f}s vs {t_plain:.2f}s without; "
            f"{PROMPT!r}: acceptance {alone['acceptance']} (predicted {checkpoints['predicted'][level]:.3f}); all "
            f"jobs: {report}; speculative={details['speculative']!r} {details.get('drafting')}; fast path: {fast}"
        )
    finally:
        rt.close()
    # each step's window chosen from what the steps measured (draft_rule): the same greedy tokens
    measured = ExLlamaRuntime(
        model, "exllamav3", cache_size=4096, draft="mtp", num_draft_tokens=WINDOW, draft_window="measured"
    )
    try:
        by_rule = [list(measured.generate(p, **GREEDY).token_ids) for p in prompts]
        with ThreadPoolExecutor(4) as ex:
            by_rule_together = [list(r.token_ids) for r in ex.map(lambda p: measured.generate(p, **GREEDY), prompts)]
        windows = measured.diagnostics()["draft_window"].report()
        print(f"MTP drafting ({level}), draft_window='measured': {windows}")
    finally:
        measured.close()
    assert by_rule == want and by_rule_together == want
    assert want[0] == [checkpoints["start"] + 1 + i for i in range(NEW)]  # the checkpoint counts upward
    assert first == want[0] and got == want and together == want
    assert streamed == results[0].text
    assert details["speculative"] == "MTP heads" and details["drafting"]["num_draft_tokens"] == WINDOW
    assert details["upstream_fixes"]["qwen3_5_text_mtp"] == 1  # text-only Qwen3.5: the head registered for it
    assert alone["jobs"] == 1 and report["jobs"] == 1 + 2 * len(prompts) + 1
    assert (usage.accepted_draft_tokens, usage.rejected_draft_tokens) == (
        alone["accepted_draft_tokens"],
        alone["rejected_draft_tokens"],
    )
    assert usage.accepted_draft_tokens > 0
    assert abs(alone["acceptance"] - checkpoints["predicted"][level]) <= 0.1


class _Scripted:
    """A draft rule that drafts, parks and drafts again on a fixed cycle of windows, whatever the steps measure."""

    CYCLE = [2] * 6 + [0] * 5 + [4] * 4 + [0] * 7 + [1] * 3 + [0] * 2 + [3] * 5

    def __init__(self) -> None:
        self.steps = 0
        self.catch_ups = 0

    def window(self, rows: int) -> int:
        self.steps += 1
        return self.CYCLE[self.steps % len(self.CYCLE)]

    def measured(self, rows: int, window: int, tokens: int, seconds: float) -> None:
        pass

    def caught_up(self, rows: int, tokens: int, seconds: float) -> None:
        self.catch_ups += 1


def test_mtp_drafting_parked_and_back_mid_generation_keeps_greedy_tokens_and_counts(
    checkpoints: dict[str, Any],
) -> None:
    """draft_window="measured" parks the drafter on a window-0 step (exllamav3 runs it without the head) and catches
    it up before the next drafted window: at 1 and 16 jobs, the tokens are those of a runtime without a drafter, and
    every drafted token is counted in the request's usage and in the model's counts."""
    from exllama_integrations import ExLlamaRuntime

    model: Path = checkpoints["mix"]  # rejections too: the recurrent state is rolled back on some windows
    batches = {1: [PROMPT], 16: [f"{PROMPT} {i}" for i in range(16)]}
    plain = ExLlamaRuntime(model, "exllamav3", cache_size=8192)
    try:
        want = {n: [list(r.token_ids) for r in plain.batch(ps, **GREEDY)] for n, ps in batches.items()}
    finally:
        plain.close()
    rt = ExLlamaRuntime(
        model, "exllamav3", cache_size=8192, draft="mtp", num_draft_tokens=WINDOW, draft_window="measured"
    )
    try:
        objects = rt.diagnostics()
        objects["driver"].draft_rule = rule = _Scripted()
        parking, drafting = objects["mtp_parking"], objects["drafting"]
        got, usage = {}, {}
        for n, ps in batches.items():
            results = rt.batch(ps, **GREEDY)
            got[n] = [list(r.token_ids) for r in results]
            usage[n] = sum(r.usage.accepted_draft_tokens + r.usage.rejected_draft_tokens for r in results)
        steps, counts = parking.report(), drafting.report()
        graphs = objects["fast_decode"].report()["graphs"]
        print(f"MTP drafting parked and back: {steps}; {counts}; catch-ups measured {rule.catch_ups}; graphs {graphs}")
    finally:
        rt.close()
    assert got == want  # the verifier decides: parked, caught up or drafting, the same greedy tokens
    assert steps["parked_steps"] > 0 and steps["catch_up_steps"] > 0 and steps["drafting_steps"] > 0
    # every drafted token in some request's usage and in the model's counts (jobs ending parked included)
    assert (
        counts["jobs"] == 17
        and usage[1] + usage[16] == counts["accepted_draft_tokens"] + counts["rejected_draft_tokens"]
    )
    assert counts["accepted_draft_tokens"] > 0 and usage[16] > 0
    # the parked step and the exporting one are two graphs kept side by side, never captured again at each switch
    if graphs.get("captured"):
        assert len(graphs["shapes"]) == len(set(graphs["shapes"]))
        assert any(s.endswith("+exports") for s in graphs["shapes"]) and any(
            s.endswith("pages") for s in graphs["shapes"]
        )


def test_a_checkpoint_without_mtp_heads_is_refused_before_anything_loads(checkpoints: dict[str, Any]) -> None:
    from exllama_integrations import ExLlamaRuntime
    from exllama_integrations.errors import UnsupportedModelError

    t0 = time.perf_counter()
    with pytest.raises(UnsupportedModelError, match=r"declares 1 MTP layer\(s\) .* but its weights hold none"):
        ExLlamaRuntime(checkpoints["none"], "exllamav3", cache_size=4096, draft="mtp")
    assert time.perf_counter() - t0 < 5
    rt = ExLlamaRuntime(checkpoints["none"], "exllamav3", cache_size=4096)  # without drafting it loads and counts
    try:
        assert list(rt.generate(PROMPT, **GREEDY).token_ids)[:3] == [checkpoints["start"] + 1 + i for i in range(3)]
    finally:
        rt.close()
