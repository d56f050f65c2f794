"""Embeddings per second, ours beside sentence-transformers on the same device and model, at batch 1 and 64.

``EmbeddingRuntime.embed`` against ``SentenceTransformer.encode`` on the same directory, in one process with the
same torch threads: batch 1 is one text per call (latency-bound, what a query costs), batch 64 one call of 64
texts (what indexing costs). Each repetition runs both, their order alternating, so a busy machine slows both
alike; medians [min..max] over the repetitions, and the paired ratio (ours / theirs) of each repetition.

CPU (what CI's machine has):  python benchmarks/embeddings.py --reps 5 --out benchmarks/results/cpu_embeddings.json
GPU: python benchmarks/embeddings.py --device cuda --backend exllamav3 --model-dir DIR (a decoder embedding model;
``--model-dir`` defaults to all-MiniLM-L6-v2, which exllamav3 does not run: use ``--backend transformers`` there).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

WORDS = (
    "the a city river model token vector index query answer paris france light energy plant language code "
    "mountain tower history music science ocean forest market bridge station library garden winter summer"
).split()


def texts(n: int, seed: int = 0) -> list[str]:
    """``n`` deterministic sentences of 8 to 40 words."""
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40))) + "." for _ in range(n)]


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", help="an embedding model directory (default: the demo all-MiniLM-L6-v2)")
    p.add_argument("--backend", default="transformers")
    p.add_argument("--device", default="cpu")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--singles", type=int, default=32, help="texts embedded one per call, per repetition")
    p.add_argument("--batches", type=int, default=3, help="calls of 64 texts per repetition")
    p.add_argument("--out", help="write the results here (JSON)")
    args = p.parse_args()

    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    from exllama_integrations.contract.retrieval import EmbeddingRequest
    from exllama_integrations.demo_embedding import embedding_model_dir
    from exllama_integrations.runtime.local import EmbeddingRuntime

    path = args.model_dir or str(embedding_model_dir())
    rt = EmbeddingRuntime(path, args.backend, device=args.device, progressbar=False)
    st = SentenceTransformer(path, device=args.device)
    singles, batch = texts(args.singles, 1), texts(64, 2)
    check = np.array(rt.embed(EmbeddingRequest(batch[:8])).vectors)
    cosine = float((check * st.encode(batch[:8], normalize_embeddings=True)).sum(1).min())

    def ours_1() -> None:
        for t in singles:
            rt.embed(EmbeddingRequest([t]))

    def theirs_1() -> None:
        for t in singles:
            st.encode([t])

    def ours_64() -> None:
        for _ in range(args.batches):
            rt.embed(EmbeddingRequest(batch))

    def theirs_64() -> None:
        for _ in range(args.batches):
            st.encode(batch, batch_size=64)

    def rate(fn, count: int) -> float:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return count / (time.perf_counter() - t0)

    cases = {
        "batch 1": (ours_1, theirs_1, args.singles),
        "batch 64": (ours_64, theirs_64, 64 * args.batches),
    }
    for ours, theirs, _ in cases.values():  # warm both (first-call allocations, kernel selection)
        ours()
        theirs()
    runs: dict[str, dict[str, list[float]]] = {k: {"ours": [], "theirs": [], "ratio": []} for k in cases}
    for rep in range(args.reps):
        for name, (ours, theirs, count) in cases.items():
            pair = [("ours", ours), ("theirs", theirs)]
            got = dict((k, rate(fn, count)) for k, fn in (pair if rep % 2 == 0 else pair[::-1]))
            runs[name]["ours"].append(got["ours"])
            runs[name]["theirs"].append(got["theirs"])
            runs[name]["ratio"].append(got["ours"] / got["theirs"])
        print(f"rep {rep + 1}/{args.reps}", {k: round(v["ours"][-1], 1) for k, v in runs.items()}, file=sys.stderr)
    rows = {
        name: {
            "exllama-integrations texts/s": summary(r["ours"]),
            "sentence-transformers texts/s": summary(r["theirs"]),
            "ratio ours / theirs": summary(r["ratio"]),
        }
        for name, r in runs.items()
    }
    result = {
        "model": Path(path).name,
        "backend": args.backend,
        "device": args.device,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, Python {platform.python_version()}",
        "torch": torch.__version__,
        "command": "python benchmarks/embeddings.py " + " ".join(a for a in sys.argv[1:] if not a.startswith("/")),
        "min_cosine_to_sentence_transformers": round(cosine, 6),
        "rows": rows,
        "runs": runs,
    }
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
