"""Speculative decoding on the H200, through ``ExLlamaLLM.stream()``, each row beside exllamav3's own Job loop.

Random weights make a real draft's acceptance meaningless, so two bounds are measured on the
Llama-2-7B shape (fp16, one stream, greedy, 128 new tokens):

* best case: the target's layers 2-31 have zero output projections (they add nothing to the residual
  stream), and the draft is the target's first 2 layers, so every drafted token is accepted;
* worst case: an unrelated 2-layer draft of the same shape (acceptance about 0);
* n-gram drafting (``ngram_match_min=2``, no draft model) on a repetitive prompt.

Each mode runs interleaved with plain decoding of the same target, ``--reps`` times; medians with min and max.

    python benchmarks/gpu_speculative.py --out DIR [--reps 5]
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RawExLlamaV3, Results, parser, public_stream  # noqa: E402

from fixture_models import LLAMA2_7B, first_layers, make_llama  # noqa: E402

RESULTS = Results("gpu_speculative.json")
record, note = RESULTS.record, RESULTS.note
DRAFT_TOKENS = 4


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--root", type=Path, default=Path("/tmp/models"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    target, best, worst = args.root / "llama7b-zero2", args.root / "draft-first2", args.root / "draft-unrelated2"
    t0 = time.perf_counter()
    if not (target / ".complete").exists():
        make_llama(target, LLAMA2_7B, seed=7, zero_after=2)
        first_layers(target, best, 2)
        make_llama(worst, dataclasses.replace(LLAMA2_7B, layers=2), seed=8)
        (target / ".complete").write_text("1")
    note(args.out, "fixture_seconds", round(time.perf_counter() - t0, 1))
    import torch

    from exllama_integrations import ExLlamaRuntime
    from exllama_integrations.langchain import ExLlamaLLM

    note(args.out, "gpu", torch.cuda.get_device_name(0))
    new, cache = args.new, 4096
    plain_rt = ExLlamaRuntime(target, "exllamav3", cache_size=cache)
    plain_llm = ExLlamaLLM(runtime=plain_rt, temperature=0, max_new_tokens=new)
    plain_raw = RawExLlamaV3(target, cache_tokens=cache)
    words = "the quick brown fox jumps over the lazy dog while other animals watch it".split()
    prompt = " ".join(words[i % len(words)] for i in range(60))
    ids = plain_rt.encode(prompt, add_special_tokens=True)

    def ours(llm: Any) -> Callable[[], dict[str, float]]:
        def run() -> dict[str, float]:
            r = public_stream(llm, prompt, ignore_eos=True)
            assert r["tokens"] == new
            return {"tok_s": r["decode_tok_s"], "ttft_s": r["ttft"]}

        return run

    def raw(loop: RawExLlamaV3) -> Callable[[], dict[str, float]]:
        def run() -> dict[str, float]:
            r = loop.jobs([ids], new)
            return {"tok_s": r["decode_tok_s"], "ttft_s": r["ttft"]}

        return run

    want = plain_rt.generate(prompt, temperature=0, max_new_tokens=new, ignore_eos=True).token_ids
    modes = {
        "best case: the target's own first 2 layers as the draft": (
            {"draft_model_dir": str(best)},
            {"draft_dir": best},
        ),
        "worst case: an unrelated 2-layer draft": ({"draft_model_dir": str(worst)}, {"draft_dir": worst}),
        "n-gram drafting (ngram_match_min=2)": ({"ngram_match_min": 2}, {"ngram_match_min": 2}),
    }
    for label, (ours_kw, raw_kw) in modes.items():
        rt = ExLlamaRuntime(target, "exllamav3", cache_size=cache, num_draft_tokens=DRAFT_TOKENS, **ours_kw)
        loop = RawExLlamaV3(target, cache_tokens=cache, num_draft_tokens=DRAFT_TOKENS, **raw_kw)
        llm = ExLlamaLLM(runtime=rt, temperature=0, max_new_tokens=new)
        same = rt.generate(prompt, temperature=0, max_new_tokens=new, ignore_eos=True).token_ids == want
        note(args.out, f"{label}: greedy tokens identical to plain decoding", same)
        paths = {
            "raw exllamav3 Job loop, plain": raw(plain_raw),
            "ExLlamaLLM.stream(), plain": ours(plain_llm),
            "raw exllamav3 Job loop, speculative": raw(loop),
            "ExLlamaLLM.stream(), speculative": ours(llm),
        }
        for f in paths.values():
            f()
        runs: dict[str, list[dict[str, float]]] = {k: [] for k in paths}
        for _ in range(args.reps):
            for k, f in paths.items():
                runs[k].append(f())
        for k, rs in runs.items():
            record(args.out, label, k, rs)
        rt.close()
        loop.close()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
