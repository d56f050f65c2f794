"""Serving overhead: one model in process vs the same model behind `exllama-integrations serve`, as users call it.

Rows, all taken in one run, interleaved, ``--reps`` times (medians with min and max):

* single stream, in process: ``ExLlamaLLM(model_dir=...).stream()`` (the baseline)
* single stream, served: ``ExLlamaLLM(base_url=...).stream()`` (RemoteRuntime over HTTP/SSE)
* single stream, served, raw: the ``openai`` client's stream against the same server
* ``--clients`` concurrent callers, in process (threads on one runtime) vs served (threads, one HTTP
  stream each): aggregate tokens/s

The server runs in its own process (as users run it), on 127.0.0.1. Decode speed is measured from
chunk arrival times (tokens after the first over the time after the first); TTFT from the call.

    python benchmarks/serve_throughput.py                      # CPU, the demo model
    python benchmarks/serve_throughput.py --model-dir DIR --backend exllamav3 --clients 64 --out results/x.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROMPT = "Write a long story about a llama who learns to fly."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed_stream(pieces: Any, new: int) -> dict[str, float]:
    t0 = time.perf_counter()
    arrivals = []
    for p in pieces:
        if p:
            arrivals.append(time.perf_counter())
    first, last = arrivals[0], arrivals[-1]
    return {"ttft_s": first - t0, "tok_s": (new - 1) / (last - first), "chunks": len(arrivals)}


def _concurrent(call: Callable[[int], int], n: int) -> dict[str, float]:
    counts = [0] * n
    t0 = time.perf_counter()
    threads = [threading.Thread(target=lambda i=i: counts.__setitem__(i, call(i))) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"agg_tok_s": sum(counts) / wall, "wall_s": wall}


def _summary(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir")
    ap.add_argument("--backend", default="transformers")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--option", action="append", default=[], help="backend load option KEY=VALUE (JSON values)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "serve_cpu.json"))
    args = ap.parse_args()

    from openai import OpenAI

    from exllama_integrations.langchain import ExLlamaLLM

    model_dir = args.model_dir
    if model_dir is None:
        from exllama_integrations.demo_model import demo_model_dir

        model_dir = str(demo_model_dir())
    options = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.option)}
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "exllama_integrations",
        "serve",
        "--model-dir",
        model_dir,
        "--backend",
        args.backend,
        "--port",
        str(port),
        *[f"--option={o}" for o in args.option],
    ]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        import httpx

        t0 = time.perf_counter()
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > 600 or server.poll() is not None:
                raise SystemExit("the server did not start")
            time.sleep(0.5)
        kw = {"temperature": 0, "max_new_tokens": args.new_tokens}
        local = ExLlamaLLM(model_dir=model_dir, backend=args.backend, backend_options=options, **kw)
        served = ExLlamaLLM(base_url=url, **kw)
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        name = served.model_name
        extra = {"ignore_eos": True}

        def raw_stream() -> Any:
            # a generator, so the request is sent inside the timed loop, as the other two rows' are
            s = client.completions.create(
                model=name, prompt=PROMPT, temperature=0, max_tokens=args.new_tokens, stream=True, extra_body=extra
            )
            yield from (c.choices[0].text for c in s if c.choices)

        singles = {
            "in process: ExLlamaLLM.stream()": lambda: local.stream(PROMPT, ignore_eos=True),
            "served: ExLlamaLLM(base_url).stream()": lambda: served.stream(PROMPT, ignore_eos=True),
            "served, raw: openai client stream": raw_stream,
        }

        def many(llm: ExLlamaLLM) -> Callable[[int], int]:
            def call(i: int) -> int:
                res = llm.generate([f"{PROMPT} ({i})"], ignore_eos=True)
                return int(res.generations[0][0].generation_info["usage"]["completion_tokens"])

            return call

        concurrent = {
            f"in process: {args.clients} threads of ExLlamaLLM.generate()": many(local),
            f"served: {args.clients} threads of ExLlamaLLM(base_url).generate()": many(served),
        }
        for f in singles.values():  # warm-up
            _timed_stream(f(), args.new_tokens)
        runs: dict[str, list[dict[str, float]]] = {k: [] for k in [*singles, *concurrent]}
        for rep in range(args.reps):
            for label, f in singles.items():
                runs[label].append(_timed_stream(f(), args.new_tokens))
            for label, call in concurrent.items():
                runs[label].append(_concurrent(call, args.clients))
            print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr)
    finally:
        server.terminate()
        server.wait(60)

    rows = []
    for label, rs in runs.items():
        row: dict[str, Any] = {"path": label, "reps": len(rs)}
        for key in rs[0]:
            row[key] = _summary([r[key] for r in rs])
        rows.append(row)
    base = rows[0]["tok_s"]["median"]
    ratios = {
        "served stream / in process (tok/s, median)": rows[1]["tok_s"]["median"] / base,
        "served raw / in process (tok/s, median)": rows[2]["tok_s"]["median"] / base,
        "served TTFT added (s, median)": rows[1]["ttft_s"]["median"] - rows[0]["ttft_s"]["median"],
        "served raw TTFT added (s, median)": rows[2]["ttft_s"]["median"] - rows[0]["ttft_s"]["median"],
        "served concurrent / in process concurrent (aggregate, median)": rows[4]["agg_tok_s"]["median"]
        / rows[3]["agg_tok_s"]["median"],
    }
    result = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "model": Path(model_dir).name,
        "backend": args.backend,
        "new_tokens": args.new_tokens,
        "clients": args.clients,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "rows": rows,
        "ratios": ratios,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    for r in rows:
        cells = "  ".join(
            f"{k}={v['median']:.3f} [{v['min']:.3f}, {v['max']:.3f}]" for k, v in r.items() if isinstance(v, dict)
        )
        print(f"{r['path']:<60} {cells}")
    for k, v in ratios.items():
        print(f"{k}: {v:.3f}")


if __name__ == "__main__":
    main()
