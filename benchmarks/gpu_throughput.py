"""GPU throughput: raw backend generators vs ExLlamaLLM.stream(), and vs transformers fp16.

Run on the lent H200 (see tests/gpu/README.md): builds a Llama-2-7B-shaped model with random
weights from a seed (fp16; a 4-bit GPTQ model; a 4-bit EXL3 model made from the fp16 one by
exllamav3's own converter), then measures, in one run: prompt 128 tokens, 256 new tokens, greedy,
batch 1, median of --reps runs, each pair (raw, ours) interleaved. With --profile, each single-stream
path is run once more under torch.profiler to split a token's time into GPU work and the rest.

    python benchmarks/gpu_throughput.py --prepare          # fixtures only (the EXL3 conversion: ~8 min)
    python benchmarks/gpu_throughput.py --profile --out benchmarks/results
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import public_stream  # noqa: E402

from fixture_models import LLAMA2_7B, Shape, convert_exl3, make_llama  # noqa: E402

NEW = 256
PROFILE_NEW = 64
RAW_NAMES = {"v3_raw": "Generator/Job", "v1_raw": "ExLlamaGenerator"}


def prompt_text(rt: Any, n: int) -> str:
    """A text of exactly n tokens under the fixture tokenizer."""
    words = ("the quick brown fox jumps over lazy dog while some other animals watch it " * 200).split()
    text = ""
    for w in words:
        cand = (text + " " + w).strip()
        if len(rt.encode(cand, add_special_tokens=True)) > n:
            break
        text = cand
    return text


def timed(fn: Callable[[], tuple[int, float | None]]) -> dict[str, float]:
    """fn returns (tokens, ttft); we add wall time."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n, ttft = fn()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"tokens": n, "wall": wall, "tps": n / wall, "ttft": ttft if ttft is not None else float("nan")}


def med(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def weight_bytes(model_dir: Path) -> int:
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))


def gpu_profile(fn: Callable[[], tuple[int, float | None]]) -> dict[str, Any]:
    """Run fn once under torch.profiler (CUDA activity only): GPU busy time and kernels per token.

    GPU busy time well under the wall time per token means the path waits on the host (Python, kernel
    launches), not on the GPU's memory bandwidth.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    try:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            n, _ = fn()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        avgs = [a for a in prof.key_averages() if getattr(a, "self_device_time_total", 0) > 0]
        busy_us = sum(a.self_device_time_total for a in avgs)
        top = sorted(avgs, key=lambda a: -a.self_device_time_total)[:6]
        return {
            "tokens": n,
            "wall_ms_per_token_under_profiler": round(wall * 1000 / n, 3),
            "gpu_busy_ms_per_token": round(busy_us / 1000 / n, 3),
            "kernels_per_token": round(sum(a.count for a in avgs) / n, 1),
            "top_kernels_ms_per_token": [[a.key[:90], round(a.self_device_time_total / 1000 / n, 4)] for a in top],
        }
    except Exception as e:  # the profile is an extra; never lose the timings for it
        return {"error": f"{type(e).__name__}: {e}"}


def ours_stream(rt: Any, text: str, new: int = NEW) -> Callable[[], tuple[int, float | None]]:
    from exllama_integrations.langchain import ExLlamaLLM

    llm = ExLlamaLLM(runtime=rt, temperature=0, max_new_tokens=new)

    def run() -> tuple[int, float | None]:
        r = public_stream(llm, text, ignore_eos=True)
        return int(r["tokens"]), r["ttft"]

    return run


def v3_raw(rt: Any, ids: list[int], new: int = NEW) -> Callable[[], tuple[int, float | None]]:
    import torch
    from exllamav3 import ArgmaxSampler, Job

    lib = rt.diagnostics()
    gen = lib["generator"]

    def run() -> tuple[int, float | None]:
        # The runtime's driver thread touches the generator only while it has jobs, and it has none
        # between our calls, so the benchmark can drive the same generator directly.
        job = Job(input_ids=torch.tensor([ids]), max_new_tokens=new, sampler=ArgmaxSampler(), stop_conditions=[])
        t0 = time.perf_counter()
        ttft = None
        n = 0
        gen.enqueue(job)
        while gen.num_remaining_jobs():
            for r in gen.iterate():
                t = r.get("token_ids")
                if t is not None and t.numel():
                    n += t.numel()
                    if ttft is None:
                        ttft = time.perf_counter() - t0
        return n, ttft

    return run


def v1_raw(rt: Any, ids: list[int], new: int = NEW) -> Callable[[], tuple[int, float | None]]:
    import torch
    from exllama.generator import ExLlamaGenerator

    lib = rt.diagnostics()

    class Tok:
        bos_token_id = 1

    gen = ExLlamaGenerator(lib["model"], Tok(), lib["cache"])
    gen.settings.top_k = 1
    gen.settings.token_repetition_penalty_max = 1.0

    def run() -> tuple[int, float | None]:
        t0 = time.perf_counter()
        gen.gen_begin(torch.tensor([ids]))
        ttft = None
        for _ in range(new):
            gen.gen_single_token()
            if ttft is None:
                ttft = time.perf_counter() - t0
        return new, ttft

    return run


def hf_generate(model_dir: Path, ids: list[int], reps: int, profile: bool) -> tuple[dict[str, float], dict[str, Any]]:
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float16).cuda().eval()
    x = torch.tensor([ids], device="cuda")
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)

    def ttft() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        m.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def gen(new: int) -> Callable[[], tuple[int, float | None]]:
        def run() -> tuple[int, float | None]:
            out = m.generate(x, max_new_tokens=new, min_new_tokens=new, **kw)
            return out.shape[1] - x.shape[1], None

        return run

    m.generate(x, max_new_tokens=8, **kw)  # warm-up
    runs = [timed(gen(NEW)) for _ in range(reps)]
    first = statistics.median(ttft() for _ in range(3))
    prof = gpu_profile(gen(PROFILE_NEW)) if profile else {}
    m.cpu()  # free the GPU for the next row
    gc.collect()
    torch.cuda.empty_cache()
    r = med(runs)
    r["ttft"] = first
    return r, prof


def pair(raw: Callable[[], Any], ours: Callable[[], Any], reps: int) -> tuple[dict[str, float], dict[str, float]]:
    raw()  # warm-up both
    ours()
    a, b = [], []
    for _ in range(reps):
        a.append(timed(raw))
        b.append(timed(ours))
    return med(a), med(b)


def prepare(work: Path, shape: Shape, only: set[str]) -> dict[str, Path]:
    """Build (once) the fixtures the chosen rows need; the EXL3 model gets a .complete marker when done."""
    dirs = {"fp16": work / "llama7b-fp16", "gptq": work / "llama7b-gptq", "exl3": work / "llama7b-exl3"}
    t = time.perf_counter()
    if only & {"v3", "exl3", "hf"} and not (dirs["fp16"] / "config.json").exists():
        make_llama(dirs["fp16"], shape, seed=7)
        print(f"fp16 fixture ready in {time.perf_counter() - t:.0f}s", flush=True)
    if "v1" in only and not (dirs["gptq"] / "config.json").exists():
        make_llama(dirs["gptq"], shape, seed=8, gptq=True, write_twin=False)
        print(f"GPTQ fixture ready in {time.perf_counter() - t:.0f}s", flush=True)
    if "exl3" in only and not (dirs["exl3"] / ".complete").exists():
        seconds = convert_exl3(dirs["fp16"], dirs["exl3"], bits=4, cal_rows=32, cal_cols=512, timeout=3000)
        (dirs["exl3"] / ".complete").write_text(f"{seconds:.0f}\n")
        print(f"EXL3 4-bit conversion done in {seconds:.0f}s", flush=True)
    return dirs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--work", default="/tmp/bench-models")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="a small shape, to check the script quickly")
    ap.add_argument("--only", default="hf,v3,exl3,v1")
    ap.add_argument("--prepare", action="store_true", help="build the fixtures and stop")
    ap.add_argument("--profile", action="store_true", help="profile each single-stream path once")
    args = ap.parse_args()
    import torch

    from exllama_integrations import ExLlamaRuntime

    shape = Shape(hidden=1024, layers=4, heads=8, kv_heads=8, inter=2816, vocab=32000) if args.small else LLAMA2_7B
    only = set(args.only.split(","))
    dirs = prepare(Path(args.work), shape, only)
    if args.prepare:
        return
    rows: list[dict[str, Any]] = []
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": shape.__dict__,
        "prompt_tokens": 128,
        "new_tokens": NEW,
        "reps": args.reps,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def row(name: str, r: dict[str, float], **extra: Any) -> None:
        rows.append({"path": name, "tokens_per_s": round(r["tps"], 1), "ttft_ms": round(r["ttft"] * 1000, 1), **extra})
        print(rows[-1], flush=True)
        # written after every row: a run cut short still leaves what it measured
        (out / "gpu_throughput.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))

    def stream_pair(label: str, rt: Any, raw_for: Callable[..., Callable[[], Any]], model_dir: Path) -> float:
        text = prompt_text(rt, 128)
        ids = rt.encode(text, add_special_tokens=True)
        meta["prompt_tokens"] = len(ids)
        raw, ours = pair(raw_for(rt, ids), ours_stream(rt, text), args.reps)
        size = {"weight_bytes": weight_bytes(model_dir)}
        row(f"{label}: raw {RAW_NAMES[raw_for.__name__]}", raw, **size)
        row(f"{label}: ExLlamaLLM.stream()", ours, ratio_vs_raw=round(ours["tps"] / raw["tps"], 3), **size)
        return float(ours["tps"])

    def profile_last_stream(rt: Any) -> None:
        """Profile after the section's timed rows: a profiler session must not precede a timing."""
        if not args.profile:
            return
        i = max(n for n, r in enumerate(rows) if r["path"].endswith("ExLlamaLLM.stream()"))
        rows[i]["profile"] = gpu_profile(ours_stream(rt, prompt_text(rt, 128), PROFILE_NEW))
        (out / "gpu_throughput.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))

    def batch16(label: str, rt: Any, one_stream: float) -> None:
        from exllama_integrations.langchain import ExLlamaLLM

        text = prompt_text(rt, 128)
        llm = ExLlamaLLM(runtime=rt, temperature=0, max_new_tokens=NEW)
        prompts = [f"{text} {i}" for i in range(16)]
        llm.batch(prompts[:2], ignore_eos=True)
        t0 = time.perf_counter()
        res = rt.batch(prompts, temperature=0, max_new_tokens=NEW, ignore_eos=True)
        wall = time.perf_counter() - t0
        agg = sum(r.usage.completion_tokens for r in res) / wall
        ttft = statistics.median(r.timings.time_to_first_token for r in res)
        row(f"{label}: batch() of 16", {"tps": agg, "ttft": ttft}, ratio_vs_one_stream=round(agg / one_stream, 2))

    # 16 jobs x (128 + 256) tokens need 32 pages of 256: a smaller cache runs the batch in waves.
    for key, label in (("v3", "exllamav3 fp16"), ("exl3", "exllamav3 EXL3 4-bit")):
        if key not in only:
            continue
        d = dirs["fp16" if key == "v3" else "exl3"]
        rt = ExLlamaRuntime(d, "exllamav3", max_seq_len=8192)
        batch16(label, rt, stream_pair(label, rt, v3_raw, d))
        profile_last_stream(rt)
        rt.close()
    if "v1" in only:
        rt = ExLlamaRuntime(dirs["gptq"], "exllama", max_seq_len=2048)
        stream_pair("exllama v1 GPTQ 4-bit", rt, v1_raw, dirs["gptq"])
        profile_last_stream(rt)
        rt.close()
    if "hf" in only:
        from exllama_integrations.model.tokenizer import NativeTokenizer

        tok = NativeTokenizer.from_model_dir(str(dirs["fp16"]))
        words = "the quick brown fox jumps over lazy dog while some other animals watch it " * 40
        ids = tok.encode(words)[:128]
        r, prof = hf_generate(dirs["fp16"], ids, max(1, args.reps - 1), args.profile)
        row(
            "transformers fp16 generate() (HuggingFacePipeline's path)",
            r,
            weight_bytes=weight_bytes(dirs["fp16"]),
            **({"profile": prof} if prof else {}),
        )
    print(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
