"""CPU: a long prompt scored in an engine process (the completions API's echo + logprobs, ``max_tokens: 0``).

What the engine's memory grows by while it scores, how long the scoring takes, and the longest the engine's
watchdog saw its driver go without progress (past ``STALL_AFTER``, 120 s, an engine is declared hung and killed).
The prompt is the demo model's tokens of a fixed text; greedy, nothing generated.

    python benchmarks/cpu_scoring.py --tokens 8000
"""

from __future__ import annotations

import argparse
import json
import threading
import time


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--top", type=int, default=1, help="top logprobs per position")
    args = parser.parse_args()

    from exllama_integrations import ExLlamaRuntime, GenerationRequest, GenerationSettings
    from exllama_integrations.demo_model import demo_model_dir

    rt = ExLlamaRuntime(demo_model_dir(), "transformers", engine="process")
    try:
        (engine,) = rt.diagnostics()["engines"]
        (pid,) = rt.diagnostics()["engine_pids"]
        text = " ".join(f"item {i} of the list is a word, and the next one follows it" for i in range(args.tokens))
        ids = tuple(rt.encode(text, add_special_tokens=False)[: args.tokens])
        rt.generate(GenerationRequest(ids[:64], GenerationSettings(max_new_tokens=1, prompt_logprobs=args.top)))
        base, peak, worst = rss_mb(pid), 0.0, 0.0
        request = GenerationRequest(ids, GenerationSettings(max_new_tokens=1, prompt_logprobs=args.top))
        done: list = []
        worker = threading.Thread(target=lambda: done.append(rt.generate(request)))
        t0 = time.perf_counter()
        worker.start()
        while worker.is_alive():
            peak = max(peak, rss_mb(pid))
            worst = max(worst, getattr(engine, "stalled", getattr(engine, "_stalled", 0.0)))
            time.sleep(0.05)
        took = time.perf_counter() - t0
        vocab = rt.model_info().vocab_size
        print(
            json.dumps(
                {
                    "tokens": len(ids),
                    "scored": len(done[0].prompt_logprobs),
                    "seconds": round(took, 1),
                    "engine_growth_mb": round(peak - base),
                    "whole_logits_mb": round(len(ids) * vocab * 4 / 2**20),
                    "longest_without_progress_s": round(worst, 1),
                }
            )
        )
    finally:
        rt.close()


if __name__ == "__main__":
    main()
