"""Prefix-aware routing on Ray Serve with 2 model replicas sharing one GPU: a follow-up turn's time to first token.

Two Serve applications run at once on one local Ray (everything on 127.0.0.1), each the two tiers of
``exllama_integrations.serve.ray.build_app`` (the OpenAI ingress in front of model replicas):

* ``routed`` (route prefix ``/r``): 2 model replicas, ``num_gpus`` = ``--share`` each, behind our
  ``PrefixAwareRouter``: a follow-up must find the replica that holds its conversation;
* ``home`` (``/h``): 1 replica with the same share: every follow-up finds its prefix there, the best a router
  can do (the baseline).

Every conversation has a ``--prefix-tokens`` prefix of its own (no replica has seen it). For each, on both
applications (which one goes first alternates): turn 1 (cold: the whole prefix is prefilled), then the follow-up
(turn 1, its answer, a new question). Timed through the OpenAI endpoint as clients call it (streamed
``/v1/completions``, time to the first text chunk). Which replica answered each request is read from the
ingress's ``/health`` (``replicas``: requests answered per replica). Rows, over the conversations: follow-up
TTFT on ``routed`` and on ``home``, cold TTFT; the paired ratio routed / home, conversation by conversation.

``--sections load``: throughput under load, the same two applications: ``--clients`` streaming ``/v1/completions``
requests of fresh ``--prompt-tokens`` prompts (``--new`` tokens each, ``ignore_eos``) from ``--procs`` client
processes, started together, on ``routed`` (2 replicas sharing the GPU) and on ``home`` (1), interleaved over
``--reps`` rounds; aggregate tok/s (the servers' usage over the wall time), median TTFT, the load generator's CPU
and the GPU's busy share; the paired ratio 2 replicas / 1. Do replicas that share a GPU pay?

    python benchmarks/gpu_ray.py --out DIR                         # H200: Llama-2-7B shape fp16, exllamav3
    python benchmarks/gpu_ray.py --out DIR --sections load --reps 7   # 64 clients on 2 replicas vs 1
    python benchmarks/gpu_ray.py --model DIR --backend transformers --prefix-tokens 300 --conversations 3
"""

from __future__ import annotations

import json
import multiprocessing
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Results, interleave, parser, summary  # noqa: E402
from _loadgen import GpuBusy, fresh_prompt, run_streams, warm  # noqa: E402

RESULTS = Results("gpu_ray.json")


def prefix_text(tokenizer: Any, n: int, seed: int) -> str:
    """About ``n`` tokens that begin with a number no other conversation has."""
    words = "a long shared system prompt about llamas their wool the mountains and the people who keep them".split()
    text = f"Conversation {seed}."
    while len(tokenizer.encode(text, add_special_tokens=False)) < n:
        text += " " + " ".join(words[(seed + len(text)) % len(words) :] + words[: (seed + len(text)) % len(words)])
    return str(tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:n]))


def stream_ttft(client: Any, url: str, prompt: str, max_tokens: int) -> tuple[float, str]:
    """Time to the first text chunk of a streamed completion, and its whole text."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    first, text = None, []
    with client.stream("POST", url + "/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{reply.status_code}: {reply.read()[:300]!r}")
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            piece = (json.loads(line[6:]).get("choices") or [{}])[0].get("text") or ""
            if piece and first is None:
                first = time.perf_counter() - t0
            text.append(piece)
    return (first if first is not None else time.perf_counter() - t0), "".join(text)


def served_by(client: Any, url: str, before: dict[str, int]) -> tuple[str | None, dict[str, int]]:
    """The replica whose count grew since ``before`` (None when not exactly one did), and the counts now."""
    now = dict(client.get(url + "/health").json().get("replicas") or {})
    grew = [r for r, n in now.items() if n > before.get(r, 0)]
    return (grew[0] if len(grew) == 1 else None), now


def prefix_routing(args: Any, urls: dict[str, str], tokenizer: Any, client: Any) -> None:
    """Every conversation's turn 1 and follow-up on both applications: TTFT, and which replica answered."""
    out = args.out
    counts = {name: dict(client.get(url + "/health").json().get("replicas") or {}) for name, url in urls.items()}
    runs: dict[str, list[dict[str, float]]] = {"follow-up, routed (2 replicas)": [], "follow-up, home (1 replica)": []}
    runs["turn 1, cold (routed)"], runs["turn 1, cold (home)"] = [], []
    placement: list[dict[str, Any]] = []
    for i in range(args.conversations):
        prefix = prefix_text(tokenizer, args.prefix_tokens, seed=1000 + i)
        order = ["routed", "home"] if i % 2 == 0 else ["home", "routed"]
        where: dict[str, Any] = {"conversation": i}
        for name in order:
            url = urls[name]
            cold, answer = stream_ttft(client, url, prefix + " Question: what do llamas eat?", 8)
            first, counts[name] = served_by(client, url, counts[name])
            follow = prefix + " Question: what do llamas eat?" + answer + " Question: and where do they sleep?"
            again, _ = stream_ttft(client, url, follow, 4)
            second, counts[name] = served_by(client, url, counts[name])
            runs[f"turn 1, cold ({name})"].append({"ttft_s": cold})
            key = "follow-up, routed (2 replicas)" if name == "routed" else "follow-up, home (1 replica)"
            runs[key].append({"ttft_s": again})
            where[name] = {"turn 1": first, "follow-up": second}
        placement.append(where)
        print(f"conversation {i}: {where}", flush=True)
    for name, rs in runs.items():
        RESULTS.record(out, "prefix", name, rs)
    ratio = [
        a["ttft_s"] / b["ttft_s"]
        for a, b in zip(runs["follow-up, routed (2 replicas)"], runs["follow-up, home (1 replica)"])
    ]
    RESULTS.data.setdefault("ratios", {})["prefix"] = {"follow-up TTFT, routed / home": {"ttft_s": summary(ratio)}}
    cold = [r["ttft_s"] for r in runs["turn 1, cold (routed)"]]
    follow_ups = [r["ttft_s"] for r in runs["follow-up, routed (2 replicas)"]]
    RESULTS.data["ratios"]["prefix"]["follow-up / cold turn 1, routed"] = {
        "ttft_s": summary([w / c for w, c in zip(follow_ups, cold)])
    }
    went_home = sum(
        p["routed"]["turn 1"] is not None and p["routed"]["turn 1"] == p["routed"]["follow-up"] for p in placement
    )
    replicas_used = sorted({p["routed"]["turn 1"] for p in placement if p["routed"]["turn 1"]})
    RESULTS.note(out, "placement", placement)
    RESULTS.note(out, "follow-ups on the replica that served turn 1 (routed)", f"{went_home} of {len(placement)}")
    RESULTS.note(out, "replicas that served a turn 1 (routed)", len(replicas_used))
    RESULTS.note(out, "requests per replica", counts)
    print(
        f"follow-up TTFT routed / home: {statistics.median(ratio):.3f} [{min(ratio):.3f}..{max(ratio):.3f}]; "
        f"went home {went_home}/{len(placement)}; turn 1 spread over {len(replicas_used)} replicas",
        flush=True,
    )


def load(args: Any, urls: dict[str, str], tokenizer: Any, client: Any) -> None:
    """``--clients`` streams at once on 2 replicas sharing the GPU and on 1, interleaved: tok/s, TTFT, GPU busy."""
    from concurrent.futures import ProcessPoolExecutor

    pool = ProcessPoolExecutor(args.procs, mp_context=multiprocessing.get_context("spawn"))
    busy = GpuBusy()
    seed = [20_000]

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    def served(url: str) -> Any:
        def run() -> dict[str, float]:
            seed[0] += args.clients
            prompts = [fresh_prompt(encode, args.prompt_tokens, seed[0] + i) for i in range(args.clients)]
            start_at = time.time() + 0.3
            jobs = [
                pool.submit(run_streams, url, prompts[i :: args.procs], args.new, start_at) for i in range(args.procs)
            ]
            parts = [f.result() for f in jobs]
            start, end = min(p["start"] for p in parts), max(p["end"] for p in parts)
            return {
                "tok_s": sum(p["tokens"] for p in parts) / (end - start),
                "ttft_s": statistics.median(t for p in parts for t in p["ttfts"]),
                "loadgen_cores": sum(p["cpu"] for p in parts) / (end - start),
                "gpu_busy": busy.mean(start, end),
            }

        return run

    try:
        assert all(f.result() for f in [pool.submit(warm) for _ in range(args.procs)])
        before = {name: dict(client.get(url + "/health").json().get("replicas") or {}) for name, url in urls.items()}
        two = f"Ray, 2 model replicas sharing the GPU (num_gpus={args.share} each): {args.clients} streaming clients"
        one = f"Ray, 1 model replica (num_gpus={args.share}): {args.clients} streaming clients"
        interleave(RESULTS, args.out, "load", {two: served(urls["routed"]), one: served(urls["home"])}, args.reps)
        RESULTS.ratios(args.out, "load", [(two, one)])
        after = {name: dict(client.get(url + "/health").json().get("replicas") or {}) for name, url in urls.items()}
        spread = {n: {r: c - before[n].get(r, 0) for r, c in after[n].items()} for n in after}
        RESULTS.note(args.out, "load: requests per replica", spread)
    finally:
        busy.close()
        pool.shutdown(cancel_futures=True)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--model", type=Path, default=Path("/tmp/models/llama7b-fp16"))
    ap.add_argument("--backend", default="exllamav3")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--prefix-tokens", type=int, default=4000)
    ap.add_argument("--share", type=float, default=0.33, help="num_gpus of each model replica (3 share one GPU)")
    ap.add_argument("--option", action="append", default=[], help="runtime option KEY=VALUE for every replica")
    ap.add_argument("--sections", default="prefix", help="prefix (follow-up TTFT), load (streams on 2 replicas vs 1)")
    ap.add_argument("--clients", type=int, default=64, help="streams of a load round")
    ap.add_argument("--procs", type=int, default=4, help="client processes of the load section")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prompt length of the load section")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out
    if args.backend == "exllamav3" and not (args.model / ".complete").exists():
        from fixture_models import LLAMA2_7B, make_llama

        make_llama(args.model, LLAMA2_7B, seed=7)
        (args.model / ".complete").write_text("1")
    from exllama_integrations.serve.ray.network import before_ray_starts

    before_ray_starts("127.0.0.1")  # as `serve --ray` does: the node on 127.0.0.1, NVLink multicast off
    import httpx
    import ray
    from ray import serve

    from exllama_integrations.model.directory import ModelDirectory
    from exllama_integrations.model.tokenizer import NativeTokenizer
    from exllama_integrations.serve.ray import build_app

    tokenizer = NativeTokenizer(ModelDirectory.inspect(args.model))
    gpus = 1 if args.backend != "transformers" else 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    ray.init(num_cpus=8, num_gpus=gpus, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    runtime = {k: json.loads(v) if v[:1].isdigit() else v for k, v in (o.split("=", 1) for o in args.option)}
    common = {"model_dir": str(args.model), "backend": args.backend, "num_cpus": 1, "runtime": runtime}
    share = args.share = args.share if gpus else 0
    apps = {"routed": ("/r", 2), "home": ("/h", 1)}
    for name, (prefix, replicas) in apps.items():
        serve.run(
            build_app({**common, "num_replicas": replicas, "num_gpus": share}),
            name=name,
            route_prefix=prefix,
            blocking=False,
        )
    urls = {name: f"http://127.0.0.1:{port}{prefix}" for name, (prefix, _) in apps.items()}
    client = httpx.Client(timeout=600)
    for url in urls.values():
        while True:
            try:
                if client.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
    RESULTS.note(out, "up_seconds", round(time.perf_counter() - t0, 1))
    RESULTS.note(out, "model", str(args.model.name))
    for url in urls.values():  # one request each, so no timed one pays a first call
        stream_ttft(client, url, "warm up", 4)
    sections = set(args.sections.split(","))
    if "load" in sections:
        load(args, urls, tokenizer, client)
    if "prefix" in sections:
        prefix_routing(args, urls, tokenizer, client)
    client.close()
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
