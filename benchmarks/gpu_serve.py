"""Serving at in-process speed: the OpenAI endpoint under 64 streaming clients, its model's driver in a thread of
the server, in an engine process of its own, and in two engine processes, beside 64 callers in process.

Every row is taken in one run, interleaved, ``--reps`` rounds (each round starting one row later), with prompts
no engine has seen (a new set every call), ``--new`` tokens each (``ignore_eos``); medians [min..max]:

* in process: ``--clients`` threads of ``ExLlamaLLM.generate()`` (the baseline), and of ``ExLlamaLLM.stream()``
* served, ``--engine thread`` / ``--engine process`` / ``--engines 2``: ``--clients`` streaming
  ``/v1/completions`` requests from ``--procs`` client processes (asyncio + httpx each), started together;
  the load generator's CPU is reported (cores busy over the row's wall time) so it is seen not to be the limit
* one stream: ``ExLlamaLLM.stream()`` in process vs one streaming request to the engine-process server

Aggregate tok/s = completion tokens (the servers' own usage) / wall time from the first request to the last end.

    python benchmarks/gpu_serve.py --out DIR                       # H200: Llama-2-7B shape, fp16, exllamav3
    python benchmarks/gpu_serve.py --out DIR --exl3                # a 1B-class shape, 4-bit EXL3
    python benchmarks/gpu_serve.py --model DIR --backend transformers --clients 8 --procs 2 --new 16 --reps 2
"""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Results, exl3_model, free_port, parser, profile, public_stream, wait_up
from _common import interleave as _interleave  # noqa: E402
from _loadgen import GpuBusy, fresh_prompt, run_streams, warm  # noqa: E402

RESULTS = Results("gpu_serve.json")
record, note, ratios = RESULTS.record, RESULTS.note, RESULTS.ratios


CAPTURED = "decode='fast': captured the decode step"
"""What a server's engine logs (``--verbose``) for each decode-step graph it captures."""


def log_path(url: str) -> Path:
    """The log of the server at ``url`` (its stdout and stderr)."""
    return Path(f"/tmp/gpu_serve_{url.rsplit(':', 1)[1]}.log")


def captures(url: str) -> int:
    """Decode-step graphs the server at ``url`` has captured so far (lines of its verbose log)."""
    try:
        return log_path(url).read_text(errors="replace").count(CAPTURED)
    except OSError:
        return 0


def triton_cache_entries() -> int:
    """Kernels in Triton's on-disk cache (one entry per compiled kernel specialization)."""
    root = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    try:
        return sum(1 for _ in root.iterdir())
    except OSError:
        return 0


def start_server(
    model: Path, backend: str, options: list[str], extra: list[str], verbose: bool = False
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "exllama_integrations", "serve", str(model), "--backend", backend, "--port", str(port)]
    for o in options:
        cmd += ["--option", o]
    cmd += ["--verbose"] * verbose
    log = open(f"/tmp/gpu_serve_{port}.log", "w")  # noqa: SIM115 - the server's whole life
    proc = subprocess.Popen([*cmd, *extra, "--max-pending", "1024"], stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def engine_pids(server_pid: int) -> list[int]:
    """The engine processes a server started."""
    import psutil

    return [
        c.pid
        for c in psutil.Process(server_pid).children(recursive=True)
        if "runtime.engine.process" in " ".join(c.cmdline())
    ]


def interleave(out: Path, section: str, paths: dict[str, Any], reps: int) -> None:
    """:func:`_common.interleave` into this benchmark's results."""
    _interleave(RESULTS, out, section, paths, reps)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--model", type=Path, default=Path("/tmp/models/llama7b-fp16"))
    ap.add_argument("--backend", default="exllamav3")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--exl3", action="store_true", help="a 1B-class Llama shape converted to 4-bit EXL3 (not --model)")
    ap.add_argument(
        "--rows",
        default="generate,stream,thread,process,engines2,single",
        help="rows to take: generate, stream, engine_in_process, thread, process, process_exllamav3, process_whole, "
        "process_half, process_window, engines2, single",
    )
    ap.add_argument("--window", type=float, default=0.02, help="arrival_window of the process_window row's server")
    ap.add_argument("--profile", action="store_true", help="py-spy on the engine-process server and its engine")
    ap.add_argument(
        "--watch",
        action="store_true",
        help="servers log verbosely (kept in --out); each served round also counts the decode-step graphs its server "
        "captured and the Triton kernels compiled (new entries in Triton's cache) while it ran",
    )
    ap.add_argument("--option", action="append", default=None, help="backend option KEY=VALUE (servers and in process)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    options = args.option if args.option is not None else (["cache_size=24576"] if args.backend == "exllamav3" else [])
    if args.exl3:  # a 1B-class Llama shape, quantized to 4-bit EXL3 by exllamav3's own converter
        args.model = exl3_model(RESULTS, args.out)
    elif args.backend == "exllamav3" and not (args.model / ".complete").exists():
        from fixture_models import LLAMA2_7B, make_llama

        t0 = time.perf_counter()
        make_llama(args.model, LLAMA2_7B, seed=7)
        (args.model / ".complete").write_text("1")
        note(args.out, "fixture_seconds", round(time.perf_counter() - t0, 1))

    from exllama_integrations.runtime.local.registry import SERVING_DEFAULTS

    note(args.out, "serving defaults (a server's model gets them unless --option says otherwise)", SERVING_DEFAULTS)
    rows_wanted = set(args.rows.split(","))
    half = [o for o in options if not o.startswith("cache_size")] + (
        ["cache_size=12288"] if args.backend == "exllamav3" else []
    )
    servers = {}
    if "thread" in rows_wanted:
        servers["thread"] = start_server(args.model, args.backend, options, ["--engine", "thread"], args.watch)
    if rows_wanted & {"process", "process_whole", "process_half", "single"}:
        servers["process"] = start_server(args.model, args.backend, options, ["--engine", "process"], args.watch)
    if "process_exllamav3" in rows_wanted:  # the server as it was before decode="fast": exllamav3's own loop
        own = [o for o in options if not o.startswith("decode=")] + ["decode=exllamav3"]
        servers["exllamav3 loop"] = start_server(args.model, args.backend, own, ["--engine", "process"], args.watch)
    if "process_window" in rows_wanted:
        window = [*options, f"arrival_window={args.window}"]
        servers["window"] = start_server(args.model, args.backend, window, ["--engine", "process"], args.watch)
    if "engines2" in rows_wanted:
        servers["2 engines"] = start_server(args.model, args.backend, half, ["--engines", "2"], args.watch)
    pool = ProcessPoolExecutor(args.procs, mp_context=multiprocessing.get_context("spawn"))
    busy = GpuBusy()
    try:
        from exllama_integrations import ExLlamaRuntime
        from exllama_integrations.langchain import ExLlamaLLM

        values = {k: json.loads(v) if v[:1].isdigit() else v for k, v in (o.split("=", 1) for o in options)}
        if not rows_wanted & {"generate", "stream", "single"} and args.backend == "exllamav3":
            values["cache_size"] = 4096  # only its tokenizer is used (the prompts): a small cache leaves memory
        rt = ExLlamaRuntime(args.model, args.backend, **values)
        llm = ExLlamaLLM(runtime=rt, temperature=0, max_new_tokens=args.new)
        llm_engine = None
        if "engine_in_process" in rows_wanted:
            rt_engine = ExLlamaRuntime(args.model, args.backend, engine="process", **values)
            llm_engine = ExLlamaLLM(runtime=rt_engine, temperature=0, max_new_tokens=args.new)
        for proc, url in servers.values():
            wait_up(url, proc, 600)
        assert all(f.result() for f in [pool.submit(warm) for _ in range(args.procs)])
        seed = [10_000]

        def fresh(n: int) -> list[str]:
            seed[0] += n
            return [fresh_prompt(rt.encode, args.prompt_tokens, seed[0] + i) for i in range(n)]

        def in_process(stream: bool, target: Any = llm) -> Any:
            def run() -> dict[str, float]:
                prompts = fresh(args.clients)
                tokens = [0] * len(prompts)
                firsts = [0.0] * len(prompts)

                def call(i: int) -> None:
                    if stream:
                        r = public_stream(target, prompts[i], ignore_eos=True)
                        tokens[i], firsts[i] = int(r["tokens"]), r["ttft"]
                    else:
                        g = target.generate([prompts[i]], ignore_eos=True).generations[0][0]
                        tokens[i] = int(g.generation_info["usage"]["completion_tokens"])
                        firsts[i] = float(g.generation_info["time_to_first_token"])

                threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
                here = cpu_seconds([os.getpid()])
                t0, w0 = time.perf_counter(), time.time()
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                wall = time.perf_counter() - t0
                return {
                    "tok_s": sum(tokens) / wall,
                    "ttft_s": statistics.median(firsts),
                    "process_cores": (cpu_seconds([os.getpid()]) - here) / wall,
                    "gpu_busy": busy.mean(w0, w0 + wall),
                }

            return run

        def served(key: str, clients: int = args.clients, stream: bool = True) -> Any:
            proc, url = servers[key]
            engines = engine_pids(proc.pid)

            def run() -> dict[str, float]:
                prompts = fresh(clients)
                per = [prompts[i :: args.procs] for i in range(args.procs)]
                start_at = time.time() + 0.3
                server0, engines0 = cpu_seconds([proc.pid]), cpu_seconds(engines)
                watched0 = (captures(url), triton_cache_entries()) if args.watch else (0, 0)
                jobs = [pool.submit(run_streams, url, p, args.new, start_at, stream) for p in per]
                parts = [f.result() for f in jobs]
                watched = (
                    {
                        "graph_captures": captures(url) - watched0[0],
                        "triton_compiles": triton_cache_entries() - watched0[1],
                    }
                    if args.watch
                    else {}
                )
                start, end = min(p["start"] for p in parts), max(p["end"] for p in parts)
                wall = end - start
                ttfts = [t for p in parts for t in p["ttfts"]]
                return {
                    "tok_s": sum(p["tokens"] for p in parts) / wall,
                    "ttft_s": statistics.median(ttfts),
                    "loadgen_cores": sum(p["cpu"] for p in parts) / wall,
                    "server_cores": (cpu_seconds([proc.pid]) - server0) / wall,
                    "engine_cores": (cpu_seconds(engines) - engines0) / wall,
                    "gpu_busy": busy.mean(start, end),
                    **watched,
                }

            return run

        def one_served(url: str) -> Any:
            def run() -> dict[str, float]:
                p = run_streams(url, fresh(1), args.new, time.time())
                return {"tok_s": (p["tokens"] - 1) / (p["end"] - p["start"] - p["ttfts"][0]), "ttft_s": p["ttfts"][0]}

            return run

        def one_local() -> dict[str, float]:
            r = public_stream(llm, fresh(1)[0], ignore_eos=True)
            return {"tok_s": r["decode_tok_s"], "ttft_s": r["ttft"]}

        n = args.clients
        base = f"in process: {n} threads of ExLlamaLLM.generate()"
        process = f"served, --engine process: {n} streaming clients"
        every = {
            "generate": (base, lambda: in_process(False)),
            "stream": (f"in process: {n} threads of ExLlamaLLM.stream()", lambda: in_process(True)),
            "engine_in_process": (
                f"in process, engine='process': {n} threads of ExLlamaLLM.generate()",
                lambda: in_process(False, llm_engine),
            ),
            "thread": (f"served, --engine thread: {n} streaming clients", lambda: served("thread")),
            "process": (process, lambda: served("process")),
            "process_exllamav3": (
                f'served, --engine process, decode="exllamav3" (its own loop): {n} streaming clients',
                lambda: served("exllamav3 loop"),
            ),
            "process_whole": (
                f"served, --engine process: {n} clients, whole bodies (not streamed)",
                lambda: served("process", stream=False),
            ),
            "process_half": (
                f"served, --engine process: {n // 2} streaming clients",
                lambda: served("process", n // 2),
            ),
            "process_window": (
                f"served, --engine process, arrival_window={args.window}: {n} streaming clients",
                lambda: served("window"),
            ),
            "engines2": (f"served, --engines 2: {n} streaming clients", lambda: served("2 engines")),
        }
        rows = {name: make() for key, (name, make) in every.items() if key in rows_wanted}
        interleave(args.out, "load", rows, args.reps)
        ratios(args.out, "load", [(k, base) for k in rows if k != base and base in rows])
        if process in rows:
            ratios(args.out, "load", [(k, process) for k in rows if k.startswith("served") and k != process])
            own = every["process_exllamav3"][0]
            if own in rows:
                ratios(args.out, "load", [(k, own) for k in rows if k.startswith("served") and k != own])
        if args.profile:  # one more round of the engine-process rows, each under py-spy
            for key in ("process", "2 engines"):
                if key not in servers:
                    continue
                proc = servers[key][0]
                pids = {"server": proc.pid, **{f"engine{i}": p for i, p in enumerate(engine_pids(proc.pid))}}
                row = served(key)
                for gil in (False, True):  # every thread's time, then who holds the GIL
                    found: dict[str, Any] = {}
                    spy = threading.Thread(target=lambda p=pids, f=found, g=gil: f.update(profile(p, 6, args.out, g)))
                    spy.start()
                    record(args.out, "profiled", f"{key}, under py-spy{' --gil' * gil} (one round)", [row()])
                    spy.join()
                    note(args.out, f"profile {key}{' (--gil)' * gil}", found)
        if "single" in rows_wanted:
            singles = {
                "in process: ExLlamaLLM.stream()": one_local,
                "served, --engine process: one streaming client": one_served(servers["process"][1]),
            }
            if "thread" in servers:
                singles["served, --engine thread: one streaming client"] = one_served(servers["thread"][1])
            interleave(args.out, "single", singles, args.reps)
            ratios(args.out, "single", [(k, "in process: ExLlamaLLM.stream()") for k in list(singles)[1:]])
        note(args.out, "host_cores", multiprocessing.cpu_count())
        rt.close()
        if llm_engine is not None:
            rt_engine.close()
    finally:
        busy.close()
        pool.shutdown(cancel_futures=True)
        for proc, _ in servers.values():
            proc.terminate()
        for proc, _ in servers.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        if args.watch:  # each server's verbose log beside the results
            for key, (_, url) in servers.items():
                if log_path(url).exists():
                    (args.out / f"server_{key.replace(' ', '_')}.log").write_bytes(log_path(url).read_bytes())


if __name__ == "__main__":
    main()
