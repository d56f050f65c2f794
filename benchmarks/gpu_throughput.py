"""GPU throughput: raw backend generators vs ExLlamaLLM.stream(), and vs transformers fp16.

Run on the lent H200 (see benchmarks/README.md): builds a Llama-2-7B-shaped model with random
weights (fp16 and a 4-bit GPTQ twin) from a seed, then measures, in one run: prompt 128 tokens,
256 new tokens, greedy, batch 1, median of --reps runs, each pair (raw, ours) interleaved.

    python benchmarks/gpu_throughput.py --out benchmarks/results
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

from fixture_models import LLAMA2_7B, Shape, make_llama  # noqa: E402

NEW = 256


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


def ours_stream(rt: Any, text: str) -> Callable[[], tuple[int, float | None]]:
    from exllama_integrations.langchain import ExLlamaLLM

    llm = ExLlamaLLM(runtime=rt, temperature=0, max_new_tokens=NEW)

    def run() -> tuple[int, float | None]:
        t0 = time.perf_counter()
        ttft = None
        info: dict[str, Any] = {}
        for chunk in llm._stream(text, ignore_eos=True):
            if ttft is None and chunk.text:
                ttft = time.perf_counter() - t0
            if chunk.generation_info:
                info = chunk.generation_info
        return int(info["completion_tokens"]), ttft

    return run


def v3_raw(rt: Any, ids: list[int]) -> Callable[[], tuple[int, float | None]]:
    import torch
    from exllamav3 import ArgmaxSampler, Job

    b = rt._backend
    gen = b._generator

    def run() -> tuple[int, float | None]:
        # The runtime's driver thread touches the generator only while it has jobs, and it has none
        # between our calls, so the benchmark can drive the same generator directly.
        job = Job(input_ids=torch.tensor([ids]), max_new_tokens=NEW, sampler=ArgmaxSampler(), stop_conditions=[])
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


def v1_raw(rt: Any, ids: list[int]) -> Callable[[], tuple[int, float | None]]:
    import torch
    from exllama.generator import ExLlamaGenerator

    b = rt._backend

    class Tok:
        bos_token_id = 1

    gen = ExLlamaGenerator(b._model, Tok(), b._cache)
    gen.settings.top_k = 1
    gen.settings.token_repetition_penalty_max = 1.0

    def run() -> tuple[int, float | None]:
        t0 = time.perf_counter()
        gen.gen_begin(torch.tensor([ids]))
        ttft = None
        for _ in range(NEW):
            gen.gen_single_token()
            if ttft is None:
                ttft = time.perf_counter() - t0
        return NEW, ttft

    return run


def hf_generate(model_dir: Path, ids: list[int], reps: int) -> dict[str, float]:
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

    def run() -> tuple[int, float | None]:
        out = m.generate(x, max_new_tokens=NEW, min_new_tokens=NEW, **kw)
        return out.shape[1] - x.shape[1], None

    m.generate(x, max_new_tokens=8, **kw)  # warm-up
    runs = [timed(run) for _ in range(reps)]
    first = statistics.median(ttft() for _ in range(3))
    m.cpu()  # free the GPU for the next row (the closures above keep a reference to m)
    gc.collect()
    torch.cuda.empty_cache()
    r = med(runs)
    r["ttft"] = first
    return r


def pair(raw: Callable[[], Any], ours: Callable[[], Any], reps: int) -> tuple[dict[str, float], dict[str, float]]:
    raw()  # warm-up both
    ours()
    a, b = [], []
    for _ in range(reps):
        a.append(timed(raw))
        b.append(timed(ours))
    return med(a), med(b)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--work", default="/tmp/bench-models")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="a small shape, to check the script quickly")
    ap.add_argument("--only", default="hf,v3,v1")
    args = ap.parse_args()
    import torch

    from exllama_integrations import ExLlamaRuntime

    shape = Shape(hidden=1024, layers=4, heads=8, kv_heads=8, inter=2816, vocab=32000) if args.small else LLAMA2_7B
    work = Path(args.work)
    fp16_dir, gptq_dir = work / "llama7b-fp16", work / "llama7b-gptq"
    t = time.perf_counter()
    if not (fp16_dir / "config.json").exists():
        make_llama(fp16_dir, shape, seed=7)
    if "v1" in args.only and not (gptq_dir / "config.json").exists():
        make_llama(gptq_dir, shape, seed=8, gptq=True, write_twin=False)
    print(f"fixtures ready in {time.perf_counter() - t:.0f}s", flush=True)
    only = set(args.only.split(","))
    rows: list[dict[str, Any]] = []
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": shape.__dict__,
        "prompt_tokens": 128,
        "new_tokens": NEW,
        "reps": args.reps,
    }

    def row(name: str, r: dict[str, float], **extra: Any) -> None:
        rows.append({"path": name, "tokens_per_s": round(r["tps"], 1), "ttft_ms": round(r["ttft"] * 1000, 1), **extra})
        print(rows[-1], flush=True)

    if "v3" in only:
        # 16 jobs x (128 + 256) tokens need 32 pages of 256: a smaller cache runs the batch in waves.
        rt = ExLlamaRuntime(fp16_dir, "exllamav3", max_seq_len=8192)
        text = prompt_text(rt, 128)
        ids = rt.encode(text, add_special_tokens=True)
        meta["prompt_tokens"] = len(ids)
        raw, ours = pair(v3_raw(rt, ids), ours_stream(rt, text), args.reps)
        row("exllamav3 fp16: raw Generator/Job", raw)
        row("exllamav3 fp16: ExLlamaLLM.stream()", ours, ratio_vs_raw=round(ours["tps"] / raw["tps"], 3))
        from exllama_integrations.langchain import ExLlamaLLM

        llm = ExLlamaLLM(runtime=rt, temperature=0, max_new_tokens=NEW)
        prompts = [f"{text} {i}" for i in range(16)]
        llm.batch(prompts[:2], ignore_eos=True)
        t0 = time.perf_counter()
        res = rt.batch(prompts, temperature=0, max_new_tokens=NEW, ignore_eos=True)
        wall = time.perf_counter() - t0
        agg = sum(r.usage.completion_tokens for r in res) / wall
        row(
            "exllamav3 fp16: batch() of 16",
            {"tps": agg, "ttft": statistics.median(r.timings.time_to_first_token for r in res)},
            ratio_vs_one_stream=round(agg / ours["tps"], 2),
        )
        rt.close()
    if "v1" in only:
        rt = ExLlamaRuntime(gptq_dir, "exllama", max_seq_len=2048)
        text = prompt_text(rt, 128)
        ids = rt.encode(text, add_special_tokens=True)
        raw, ours = pair(v1_raw(rt, ids), ours_stream(rt, text), args.reps)
        row("exllama v1 GPTQ 4-bit: raw ExLlamaGenerator", raw)
        row("exllama v1 GPTQ 4-bit: ExLlamaLLM.stream()", ours, ratio_vs_raw=round(ours["tps"] / raw["tps"], 3))
        rt.close()
    if "hf" in only:
        from exllama_integrations.runtime.tokenizer import NativeTokenizer

        tok = NativeTokenizer.from_model_dir(str(fp16_dir))
        words = "the quick brown fox jumps over lazy dog while some other animals watch it " * 40
        ids = tok.encode(words)[:128]
        row(
            "transformers fp16 generate() (HuggingFacePipeline's path)",
            hf_generate(fp16_dir, ids, max(1, args.reps - 1)),
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_throughput.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
