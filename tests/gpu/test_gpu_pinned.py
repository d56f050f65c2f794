"""``deterministic=True``'s pinned strategy on the GPU: the whole batch in one captured step, its launch choices pinned
(``fast/pinned.py``, ``fast/seam/pins.py``), selected by its switch (``fast/deterministic.py`` STRATEGY).

The invariance table, through ``ExLlamaRuntime``, on the benchmarks' 1B-class Llama in fp16 and in 4-bit EXL3 (the
model where exllamav3's own loop and the default keep only 2 of 8 probes' tokens inside a batch, docs/determinism.md):
8 probes' greedy and seeded tokens alone == inside 16 == inside 64 (scattered among other prompts), == after other
prompts sharing a page and a half of each probe were prefilled, and a chat's next turn == the same turn on a fresh
runtime; every decode step ran pinned (no call left as it was) and whole (no row apart, replayed, run ahead). What
the default gives on the same probes is printed beside it. Last, ``deterministic=True``'s prefill in 2,048-token
chunks (fast/chunk_plan.py): long prompts keep their cold tokens after prefix hits and in 16 and 64. Skipped without
CUDA. The price:
``benchmarks/gpu_fast_decode.py --sections bench --pinned-row`` (``bash tests/gpu/run_on_device.sh probe``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.gpu

SRC, EXL3 = Path("/tmp/models/llama1b-fp16"), Path("/tmp/models/llama1b-exl3")
AT16 = [0, 2, 5, 6, 9, 11, 12, 15]  # where the probes sit among the other prompts (as benchmarks/gpu_invariance.py)
AT64 = [1, 9, 17, 30, 33, 47, 50, 63]
GREEDY = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "max_new_tokens": 32, "ignore_eos": True}


@pytest.fixture(scope="module")
def models() -> dict[str, Path]:
    """The 1B fixture of ``benchmarks/_common.exl3_model`` (same shape, seed and paths: built once per machine)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from fixture_models import Shape, convert_exl3, make_llama

    if not (EXL3 / ".complete").exists():
        make_llama(SRC, Shape(hidden=2048, layers=16, heads=16, kv_heads=8, inter=5632, vocab=32000), seed=8)
        convert_exl3(SRC, EXL3, bits=4, timeout=400)
        (EXL3 / ".complete").write_text("1")
    return {"fp16": SRC, "exl3": EXL3}


@pytest.fixture
def pinned() -> Iterator[None]:
    """The switch flipped for this test: ``deterministic=True`` runs the pinned strategy."""
    from exllama_integrations.backends.exllamav3.fast import deterministic as det

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(det, "STRATEGY", det.PINNED)
        yield


def ids(seed: int, n: int, length: int) -> list[list[int]]:
    import torch

    return torch.randint(10, 32000, (n, length), generator=torch.Generator().manual_seed(seed)).tolist()


def mixed(probes: list[list[int]], others: list[list[int]], at: list[int]) -> list[list[int]]:
    it = iter(others)
    return [probes[at.index(i)] if i in at else next(it) for i in range(len(at) + len(others))]


def seeded(prompts: list[list[int]], seeds: dict[int, int]) -> list[Any]:
    """One request per prompt, each with its own seed (a probe keeps its seed wherever it sits)."""
    from exllama_integrations import GenerationRequest, GenerationSettings

    return [
        GenerationRequest(tuple(p), GenerationSettings(**SAMPLED, seed=seeds.get(i, 7 + i)))
        for i, p in enumerate(prompts)
    ]


def situations(rt: Any) -> dict[str, list[list[int]]]:
    """The probes' tokens alone, in 16 and in 64 (greedy), and alone and in 16 (seeded)."""
    probes, others = ids(1, 8, 300), ids(2, 56, 300)
    out = {"alone": [list(rt.generate(p, **GREEDY).token_ids) for p in probes]}
    r16 = rt.batch(mixed(probes, others[:8], AT16), **GREEDY)
    out["in 16"] = [list(r16[i].token_ids) for i in AT16]
    r64 = rt.batch(mixed(probes, others, AT64), **GREEDY)
    out["in 64"] = [list(r64[i].token_ids) for i in AT64]
    out["sampled alone"] = [list(rt.batch(seeded([p], {0: 100 + i}))[0].token_ids) for i, p in enumerate(probes)]
    s16 = rt.batch(seeded(mixed(probes, others[:8], AT16), {at: 100 + i for i, at in enumerate(AT16)}))
    out["sampled in 16"] = [list(s16[i].token_ids) for i in AT16]
    return out


def kept(got: dict[str, list[list[int]]]) -> dict[str, int]:
    """Per situation, the probes (of 8) whose tokens are their tokens alone."""
    return {
        "in 16": sum(a == b for a, b in zip(got["in 16"], got["alone"])),
        "in 64": sum(a == b for a, b in zip(got["in 64"], got["alone"])),
        "sampled in 16": sum(a == b for a, b in zip(got["sampled in 16"], got["sampled alone"])),
    }


@pytest.mark.parametrize("weights", ["exl3", "fp16"])
def test_pinned_a_requests_tokens_are_its_tokens_alone_in_16_and_in_64(
    models: dict[str, Path], weights: str, pinned: None
) -> None:
    from exllama_integrations import ExLlamaRuntime

    with ExLlamaRuntime(models[weights], "exllamav3", cache_size=65536, deterministic=True) as rt:
        assert rt.diagnostics()["fast_decode"].report()["deterministic_strategy"] == "pinned"
        got = situations(rt)
        report = rt.diagnostics()["fast_decode"].report()
    with ExLlamaRuntime(models[weights], "exllamav3", cache_size=65536) as default:  # the default, for the record
        before = kept(situations(default))
    print(f"pinned, {weights}: probes kept alone / in 16 / in 64: {kept(got)}; the default: {before}; {report}")
    assert kept(got) == {"in 16": 8, "in 64": 8, "sampled in 16": 8}, (kept(got), before)
    calls = report["pins"]["calls"]
    assert calls.get("attention pinned", 0) > 0 and "attention left as it was" not in calls, calls
    gemms = "EXL3 GEMM" if weights == "exl3" else "fp16 GEMM"
    assert calls.get(f"{gemms} pinned", 0) > 0 and f"{gemms} left as it was" not in calls, calls
    assert "row_forwards" not in report and report["graphs"]["capture_failed"] == {}, report
    assert report["graphs"]["replays"] > 0 and report["graphs"]["run_ahead"]["used"] > 0, report["graphs"]


@pytest.mark.parametrize("weights", ["exl3", "fp16"])
def test_pinned_a_requests_tokens_after_another_prefix_history_are_its_cold_tokens(
    models: dict[str, Path], weights: str, pinned: None
) -> None:
    """Probes after 8 prompts sharing each probe's first page and half of its second were prefilled, and each chat's
    next turn (its answer completed a page while decoding), against the same on a fresh runtime."""
    from exllama_integrations import ExLlamaRuntime

    probes, more = ids(3, 8, 500), ids(4, 8, 500)
    history = [p[:378] + q[:122] for p, q in zip(probes, more)]
    load = {"cache_size": 65536, "deterministic": True}
    with ExLlamaRuntime(models[weights], "exllamav3", **load) as warm:
        warm.batch(history, **GREEDY)
        after = [list(warm.generate(p, **GREEDY).token_ids) for p in probes]
        turns = [p + a + q[:40] for p, a, q in zip(probes, after, ids(5, 8, 40))]
        next_turn = [list(warm.generate(p, **GREEDY).token_ids) for p in turns]
        report = warm.diagnostics()["fast_decode"].report()
    with ExLlamaRuntime(models[weights], "exllamav3", **load) as cold:
        alone = [list(cold.generate(p, **GREEDY).token_ids) for p in probes]
        turn_alone = [list(cold.generate(p, **GREEDY).token_ids) for p in turns]
    kept_after = sum(a == b for a, b in zip(after, alone))
    kept_turn = sum(a == b for a, b in zip(next_turn, turn_alone))
    print(f"pinned, {weights}: after history {kept_after}/8, next turn {kept_turn}/8; {report.get('pins')}")
    assert (kept_after, kept_turn) == (8, 8)
    assert report["deterministic_strategy"] == "pinned" and report["private_pages"] >= 8, report


@pytest.mark.parametrize("weights", ["exl3", "fp16"])
def test_deterministic_long_prompts_keep_their_cold_tokens_after_prefix_hits_and_in_16_and_64(
    models: dict[str, Path], weights: str
) -> None:
    """``deterministic=True`` (its default strategy) prefills in 2,048-token chunks from position 0 and reuses whole
    cached chunks only (fast/chunk_plan.py): 8 probes of 2,600 tokens, alone on a fresh runtime, against the same
    after 4,200-token histories that share with probes 0-3 their first chunk and 3 pages of the second (8 pages reused,
    3 computed again) and with probes 4-7 their first 3 pages (none reused, 3 computed again), then inside 16 and 64
    prompts arriving together with more such prompts (prefix hits within the batch, the probes' own pages cached)."""
    from exllama_integrations import ExLlamaRuntime

    probes, tails = ids(6, 8, 2600), ids(7, 8, 3500)
    shared = [2048 + 3 * 256 + 5] * 4 + [3 * 256 + 5] * 4
    history = [p[:n] + t[: 4200 - n] for p, n, t in zip(probes, shared, tails)]
    others = [p[: 2048 + 256 * (i % 4)] + t[:400] for i, (p, t) in enumerate(zip(probes * 7, ids(8, 56, 400)))]
    load = {"cache_size": 262144, "deterministic": True}
    with ExLlamaRuntime(models[weights], "exllamav3", **load) as cold:
        alone = [list(cold.generate(p, **GREEDY).token_ids) for p in probes]  # unrelated prompts: no prefix hit
        report = cold.diagnostics()["fast_decode"].report()
    assert report["prefill_blocks"]["pages_a_chunk"] == 8 and report["prefill_blocks"]["pages_reused"] == 0, report
    with ExLlamaRuntime(models[weights], "exllamav3", **load) as warm:
        warm.batch(history, **GREEDY)
        after = [list(warm.generate(p, **GREEDY).token_ids) for p in probes]
        blocks = dict(warm.diagnostics()["fast_decode"].report()["prefill_blocks"])
        r16 = warm.batch(mixed(probes, others[:8], AT16), **GREEDY)
        r64 = warm.batch(mixed(probes, others, AT64), **GREEDY)
        report = warm.diagnostics()["fast_decode"].report()
    got = {
        "after history": sum(a == b for a, b in zip(after, alone)),
        "in 16": sum(list(r16[i].token_ids) == b for i, b in zip(AT16, alone)),
        "in 64": sum(list(r64[i].token_ids) == b for i, b in zip(AT64, alone)),
    }
    print(f"deterministic, {weights}, 2,600-token probes: kept {got}; blocks after history {blocks}; now {report}")
    assert got == {"after history": 8, "in 16": 8, "in 64": 8}, got
    assert blocks["pages_reused"] >= 4 * 8 and blocks["pages_recomputed"] >= 8 * 3, blocks  # the hits happened
