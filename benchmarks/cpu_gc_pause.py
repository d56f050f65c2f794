"""CPU: how long a full garbage collection holds the GIL in a serving process, and after ``gc.freeze()``.

A process with torch, a model, LangChain and LlamaIndex loaded (what ``exllama-integrations serve`` runs
holds the same), one chat answered; then full collections (``gc.collect(2)``) timed with nothing frozen
and after ``gc.freeze()``, interleaved. While a collection runs, no generation in the process advances.

    python benchmarks/cpu_gc_pause.py --reps 5
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import summary  # noqa: E402


def full_collection_ms() -> float:
    t = time.perf_counter()
    gc.collect(2)
    return 1000 * (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()

    from exllama_integrations import ExLlamaRuntime
    from exllama_integrations.demo_model import demo_model_dir
    from exllama_integrations.langchain import ChatExLlama
    from exllama_integrations.llama_index import ExLlamaLLM

    rt = ExLlamaRuntime(demo_model_dir(), "transformers")
    ChatExLlama(runtime=rt, temperature=0, max_tokens=4).invoke("Hello")
    ExLlamaLLM(runtime=rt, temperature=0, max_new_tokens=4).complete("Hello")
    runs: dict[str, list[float]] = {"nothing frozen": [], "after gc.freeze()": []}
    tracked = {"nothing frozen": 0, "after gc.freeze()": 0}
    for _ in range(args.reps):
        gc.unfreeze()
        tracked["nothing frozen"] = len(gc.get_objects())
        runs["nothing frozen"].append(full_collection_ms())
        gc.freeze()
        tracked["after gc.freeze()"] = len(gc.get_objects())
        runs["after gc.freeze()"].append(full_collection_ms())
    out = {
        "machine": f"{platform.machine()}, {platform.python_version()}",
        "command": f"python benchmarks/cpu_gc_pause.py --reps {args.reps}",
        "rows": {"full collection": {k: {"ms": summary(v), "objects_scanned": tracked[k]} for k, v in runs.items()}},
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu_gc_pause.json").write_text(json.dumps(out, indent=1))
    for k, v in runs.items():
        s = summary(v)
        print(f"full collection, {k}: {s['median']:.1f} [{s['min']:.1f}..{s['max']:.1f}] ms, {tracked[k]} objects")


if __name__ == "__main__":
    main()
