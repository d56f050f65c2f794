"""The 2026 families on exllamav3 against their carried fp32 oracle: one JSON line per family, written as it comes.

Reads the folder ``tests/gpu/build_family_fixtures.py`` wrote (carried: the GPU machine's transformers lacks some of
these classes) and, per family, on exllamav3 through the runtime:

* ``load``: the runtime loads it (a typed refusal is recorded as ``refused`` with its reason), the upstream fixes
  applied (``patches``), the load seconds;
* ``oracle``: prefill logits (exllamav3's own forward) and every decode step's (a Job with ``return_logits``, while
  its greedy tokens agree with the oracle's) against the carried fp32 ``ref`` rows, within 5% of their standard
  deviation (the matrix's rule); greedy tokens of exllamav3's loop and of ``rt.generate`` against the oracle's;
* ``prefix``: a second turn that shares a ~2,300-token prefix with the first, on the runtime that served the first
  (prefix pages and, for recurrent families, exllamav3's recurrent-state checkpoints) and on a fresh one: the same
  tokens warm and cold, how many prompt tokens the warm run read from the cache, and agreement with the oracle's
  cold-run tokens;
* ``fast``: ``decode="fast"`` against exllamav3's own loop, greedy tokens at 1 and 16 jobs, and its report (graphs
  captured, or where it stood aside and why).

Each phase runs in its own try: an error is recorded (type, message, the last frames) and the next phase and family
go on. Lines go to ``$OUT/family_matrix.jsonl`` (flushed per family) and stdout.

    python tests/gpu/family_matrix.py --fixtures DIR [--families qwen3_5,gemma4] [--phases load,oracle,prefix,fast]

The same checks run as ``pytest -m gpu tests/gpu/test_gpu_models.py -k families`` with ``EXLLAMA_FAMILY_FIXTURES=DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PHASES = ("load", "oracle", "prefix", "fast")
CACHE = 16384
JOBS = (1, 16, 64)
"""Batch sizes of the fast phase: its greedy tokens against exllamav3's own loop's at each."""
MOE = (
    "qwen3_5_moe",
    "qwen3_next",
    "glm4_moe",
    "glm4_moe_lite",
    "deepseek_v3",
    "deepseek_v4",
    "minimax_m2",
    "nemotron_h",
    "kimi_linear",
    "gpt_oss",
)
SLACK = dict.fromkeys(MOE, 5.0)
"""An MoE family's row may read ``approximate`` (its worst logit difference within 5x the tolerance, every greedy token
the oracle's), as Qwen3-MoE's decode does in the matrix today (exllamav3's expert path keeps fp16 intermediates); the
row keeps the numbers, so whether the reason holds for a family is read from them, not assumed."""


def _error(e: BaseException) -> dict[str, Any]:
    return {"type": type(e).__name__, "message": str(e)[:600], "where": traceback.format_exc(limit=-4)[-1500:]}


def _phase(record: dict[str, Any], name: str, run: Callable[[], dict[str, Any]]) -> bool:
    t0 = time.perf_counter()
    try:
        record[name] = run()
        ok = True
    except Exception as e:  # noqa: BLE001 - recorded, never hidden: the matrix row says what failed
        record[name] = {"error": _error(e)}
        ok = False
    record[name]["seconds"] = round(time.perf_counter() - t0, 2)
    return ok


def _agree(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _options(backend: str, decode: str = "exllamav3") -> dict[str, Any]:
    return {"cache_size": CACHE, "decode": decode} if backend == "exllamav3" else {}


def check_family(path: Path, phases: tuple[str, ...] = PHASES, backend: str = "exllamav3") -> dict[str, Any]:
    """One family's row (see the module docstring). ``backend="transformers"``: the same checks on the CPU reference
    (a dry run of this script: its oracle rows must match there to the last digit)."""
    from safetensors.torch import load_file

    from exllama_integrations import ExLlamaRuntime, UnsupportedModelError

    oracle = json.loads((path / "oracle.json").read_text())
    name = oracle["family"]
    record: dict[str, Any] = {
        "arch": name,
        "family": name,
        "config": oracle.get("config", oracle["architecture"]),
        "architecture": oracle["architecture"],
        "backend": backend,
    }
    ref = load_file(str(path / "oracle.safetensors"))["ref"]
    ids, want = oracle["prompt_ids"], oracle["greedy_tokens"]
    steps = len(want)
    tol = 0.05 * float(ref.std())
    try:
        t0 = time.perf_counter()
        rt = ExLlamaRuntime(path, backend, **_options(backend))
        record["load"] = {
            "seconds": round(time.perf_counter() - t0, 2),
            "patches": rt.model_info().details.get("upstream_fixes", {}),
        }
    except UnsupportedModelError as e:
        record.update(status="refused", why=str(e))
        return record
    except Exception as e:  # noqa: BLE001 - a family exllamav3 cannot load: its row says why
        record.update(status="load failed", load={"error": _error(e)})
        return record
    try:
        if "oracle" in phases:
            _phase(record, "oracle", lambda: _oracle(rt, ids, want, ref, tol, SLACK.get(name, 1.0)))
        if "prefix" in phases:
            _phase(record, "prefix", lambda: _prefix(rt, path, oracle, backend))
    finally:
        rt.close()
    if "fast" in phases and backend == "exllamav3":
        _phase(record, "fast", lambda: _fast(path, ids, steps))
    got = record.get("oracle", {})
    record["status"] = got.get("status", "error" if "oracle" in phases else "loaded")
    if "decode_max_logit_diff" in got:  # the matrix's row shape (benchmarks/results/gpu_arch_matrix.jsonl)
        record["prefill_max_logit_diff"] = got.get("prefill_max_logit_diff", got["step0_max_logit_diff"])
        for key in ("decode_max_logit_diff", "tolerance", "decode_steps_compared", "greedy_tokens_agree"):
            record[key] = got[key]
        record["runtime_tokens_agree"] = got["runtime_tokens_agree"]
    return record


def _oracle(rt: Any, ids: list[int], want: list[int], ref: Any, tol: float, slack: float) -> dict[str, Any]:
    import torch
    from test_gpu_contract import _decode_logits

    out: dict[str, Any] = {"tolerance": round(tol, 5), "steps": len(want)}
    try:
        with torch.inference_mode():
            model = rt.diagnostics()["model"]
            prefill = model.forward(torch.tensor([ids], dtype=torch.long)).float()[0, -1].cpu()
        out["prefill_max_logit_diff"] = round(float((prefill[: ref.shape[1]] - ref[0]).abs().max()), 5)
    except Exception as e:  # noqa: BLE001 - a recurrent model may need its state params for a bare forward
        out["prefill_forward_error"] = _error(e)
    logits, got = _decode_logits(rt, ids, want)
    agree = _agree(got, want)
    n = min(agree + 1, len(logits), len(want))
    diffs = (logits[:n, : ref.shape[1]] - ref[:n]).abs().amax(dim=-1)
    out["step0_max_logit_diff"] = round(float(diffs[0]), 5)  # the prefill's last position, through the Job
    out["decode_max_logit_diff"] = round(float(diffs.max()), 5)
    out["worst_step"] = int(diffs.argmax())
    out["decode_steps_compared"] = n
    out["greedy_tokens_agree"] = agree
    through = rt.generate(tuple(ids), temperature=0, max_tokens=len(want), ignore_eos=True)
    out["runtime_tokens_agree"] = _agree(list(through.token_ids), want)
    prefill_diff = out.get("prefill_max_logit_diff", out["step0_max_logit_diff"])
    worst = max(prefill_diff, out["decode_max_logit_diff"])
    if worst <= tol:
        out["status"] = "ok"
    elif worst <= slack * tol and agree == len(want):
        out["status"] = "approximate"
    else:
        out["status"] = "wrong"
    return out


def _prefix(rt: Any, path: Path, oracle: dict[str, Any], backend: str) -> dict[str, Any]:
    from exllama_integrations import ExLlamaRuntime

    turn1, turn2, want2 = oracle["turn1_ids"], oracle["turn2_ids"], oracle["turn2_tokens"]
    kw = {"temperature": 0, "max_tokens": len(want2), "ignore_eos": True}
    first = rt.generate(tuple(turn1), **kw)
    warm = rt.generate(tuple(turn2), **kw)
    with ExLlamaRuntime(path, backend, **_options(backend)) as fresh:
        cold = fresh.generate(tuple(turn2), **kw)
    return {
        "shared_prompt_tokens": oracle["turns_share_tokens"],
        "turn2_prompt_tokens": len(turn2),
        "warm_cached_tokens": warm.usage.cached_tokens,
        "cold_cached_tokens": cold.usage.cached_tokens,
        "warm_equals_cold": list(warm.token_ids) == list(cold.token_ids),
        "warm_tokens_agree_with_oracle": _agree(list(warm.token_ids), want2),
        "cold_tokens_agree_with_oracle": _agree(list(cold.token_ids), want2),
        "turn1_tokens_agree_with_oracle": _agree(list(first.token_ids), oracle["turn1_tokens"]),
    }


def _fast(path: Path, ids: list[int], steps: int) -> dict[str, Any]:
    from exllama_integrations import ExLlamaRuntime

    out: dict[str, Any] = {}
    kw = {"temperature": 0, "max_tokens": steps, "ignore_eos": True}
    prompts = [tuple(ids[: max(2, len(ids) - j)]) for j in range(16)]  # 16 distinct prompts (ragged lengths)
    prompts += [(*prompts[j % 16], 3 + j) for j in range(16, 64)]  # and 48 more, each a token longer
    cache = 2 * CACHE  # a page each for 64 jobs, and room for recurrent checkpoints
    with ExLlamaRuntime(path, "exllamav3", cache_size=cache, decode="exllamav3") as plain:
        want = {jobs: [list(r.token_ids) for r in plain.batch(prompts[:jobs], **kw)] for jobs in JOBS}
    with ExLlamaRuntime(path, "exllamav3", cache_size=cache, decode="fast", fast_recurrent=True) as fast:
        for jobs in JOBS:
            got = [list(r.token_ids) for r in fast.batch(prompts[:jobs], **kw)]
            out[f"jobs_{jobs}_identical"] = sum(a == b for a, b in zip(got, want[jobs]))
        out["report"] = _plain(fast.diagnostics()["fast_decode"].report())  # (model_info is a snapshot at load)
    return out


def _plain(value: Any) -> Any:
    """A report as JSON (dataclasses and odd values as text)."""
    try:
        json.dumps(value)
        return value
    except TypeError:
        return str(value)[:2000]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fixtures", type=Path, required=True)
    ap.add_argument("--families", default="")
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--backend", default="exllamav3", help="transformers: a CPU dry run of the same checks")
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    wanted = set(filter(None, args.families.split(",")))
    phases = tuple(p for p in args.phases.split(",") if p)
    results = out / "family_matrix.jsonl"
    for path in sorted(p for p in args.fixtures.iterdir() if (p / "oracle.json").is_file()):
        if wanted and path.name not in wanted:
            continue
        try:
            record = check_family(path, phases, args.backend)
        except Exception as e:  # noqa: BLE001 - the next family still runs
            record = {"family": path.name, "status": "error", "error": _error(e)}
        line = json.dumps(record)
        with results.open("a") as f:
            f.write(line + "\n")
        print(line, flush=True)
        try:
            import torch

            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001, S110 - best effort between families
            pass


if __name__ == "__main__":
    main()
