"""CPU: ExLlamaLLM.stream() tokens/s against a plain transformers generate() on the same model and prompt.

Both run the demo model (SmolLM2-135M-Instruct) in fp32 on the CPU, greedy, the same number of new
tokens (EOS ignored), interleaved, in one process: the ratio is what counts on a noisy machine.

    python benchmarks/cpu_stream_vs_generate.py --new-tokens 128 --reps 5
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import public_stream  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from exllama_integrations.demo_model import demo_model_dir
    from exllama_integrations.langchain import ExLlamaLLM

    model_dir = demo_model_dir()
    prompt = "Write a short story about a llama who learns to program computers."
    llm = ExLlamaLLM(model_dir=str(model_dir), backend="transformers", temperature=0, max_new_tokens=args.new_tokens)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([llm.exllama_runtime.encode(prompt, add_special_tokens=True)])

    def run_hf() -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(
                ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=2
            )
        n = out.shape[1] - ids.shape[1]
        assert n == args.new_tokens
        return n / (time.perf_counter() - t0)

    def run_ours() -> float:
        r = public_stream(llm, prompt, ignore_eos=True)
        assert r["tokens"] == args.new_tokens
        return r["tps"]

    run_hf(), run_ours()  # warm-up
    hf_runs, our_runs = [], []
    for _ in range(args.reps):
        hf_runs.append(run_hf())
        our_runs.append(run_ours())
    hf_tps, our_tps = statistics.median(hf_runs), statistics.median(our_runs)
    result = {
        "model": "SmolLM2-135M-Instruct (fp32, CPU)",
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads",
        "torch": torch.__version__,
        "prompt_tokens": ids.shape[1],
        "new_tokens": args.new_tokens,
        "reps": args.reps,
        "transformers_generate_tps": round(hf_tps, 2),
        "exllamallm_stream_tps": round(our_tps, 2),
        "ratio": round(our_tps / hf_tps, 3),
        "runs": {"transformers": [round(x, 2) for x in hf_runs], "ours": [round(x, 2) for x in our_runs]},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_stream_vs_generate.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
