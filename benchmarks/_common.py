"""What the benchmarks share: the public-API stream timed with its usage, and exllamav3 driven raw, as users drive it.

"Ours" rows go through what users call (``ExLlamaLLM.stream()`` with a callback for the usage), never
private members; "raw" rows build exllamav3's own objects from the same model directory.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (servers a benchmark starts listen there only)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_up(url: str, proc: Any, seconds: float) -> None:
    """Until the server ``proc`` (a ``subprocess.Popen``) at ``url`` answers ``/health``; raises if it exits first
    or ``seconds`` pass."""
    import httpx

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server at {url} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server at {url} did not come up in {seconds:.0f} s")


def public_stream(llm: Any, text: str, **kwargs: Any) -> dict[str, float]:
    """Time ``llm.stream(text)``: tokens (from the usage LangChain's callbacks report), TTFT, decode tok/s."""
    from langchain_core.callbacks import BaseCallbackHandler

    class Usage(BaseCallbackHandler):
        tokens = 0

        def on_llm_end(self, response: Any, **kw: Any) -> None:
            Usage.tokens = int(response.generations[0][0].generation_info["usage"]["completion_tokens"])

    t0 = time.perf_counter()
    arrivals = [time.perf_counter() for piece in llm.stream(text, config={"callbacks": [Usage()]}, **kwargs) if piece]
    wall = time.perf_counter() - t0
    first, last = arrivals[0], arrivals[-1]
    return {
        "tokens": Usage.tokens,
        "wall": wall,
        "tps": Usage.tokens / wall,
        "decode_tok_s": (Usage.tokens - 1) / (last - first) if last > first else float("nan"),
        "ttft": first - t0,
    }


class RawExLlamaV3:
    """exllamav3 on its own: Config -> Model -> Cache -> Tokenizer -> Generator, jobs enqueued and iterated."""

    def __init__(
        self,
        model_dir: Path,
        cache_tokens: int = 65536,
        max_batch_size: int = 64,
        draft_dir: Path | None = None,
        pauses: GcPauses | None = None,
        mtp: bool = False,
        **generator_kw: Any,
    ) -> None:
        """``draft_dir``: a draft model; ``mtp``: the checkpoint's own MTP heads draft (as exllamav3's ``model_init
        --mtp`` and TabbyAPI's ``draft_mode: mtp`` build them: ``Model.from_config(config, component="mtp")``)."""
        from exllamav3 import Cache, Config, Generator, Model, Tokenizer

        config = Config.from_directory(str(model_dir))
        self.model = Model.from_config(config)
        self.draft = None
        if mtp:
            from exllama_integrations.backends.exllamav3.patches import qwen3_5_text_mtp

            qwen3_5_text_mtp(config)  # exllamav3 1.6.5 registers no MTP component for text-only Qwen3.5 configs
            self.draft = Model.from_config(config, component="mtp")
        elif draft_dir is not None:  # speculative decoding, as exllamav3's examples set it up
            self.draft = Model.from_config(Config.from_directory(str(draft_dir)))
        drafted = generator_kw.get("num_draft_tokens") or (self.draft.caps.get("default_draft_size", 4) if mtp else 4)
        drafting = self.draft is not None or generator_kw.get("ngram_match_min")
        history = {"max_history": drafted} if drafting else {}  # a recurrent model's rollback room (Qwen3.5)
        self.cache = Cache(self.model, max_num_tokens=cache_tokens, **history)
        self.model.load(progressbar=False)
        if self.draft is not None:
            generator_kw["draft_cache"] = Cache(self.draft, max_num_tokens=cache_tokens, **history)
            self.draft.load(progressbar=False)
            generator_kw["draft_model"] = self.draft
        self.last: dict[str, Any] = {}
        """After :meth:`jobs` of one prompt: its ``token_ids`` and, when drafting, its accepted and rejected drafts."""
        self.tokenizer = Tokenizer.from_config(config)
        self.generator = Generator(
            self.model, self.cache, self.tokenizer, max_batch_size=max_batch_size, **generator_kw
        )
        self.timer = IterateTimer(self.generator, pauses)

    def jobs(self, prompts: list[list[int]], new: int) -> dict[str, float]:
        """All prompts enqueued together, greedy, ``new`` tokens each: aggregate tok/s and median TTFT."""
        import torch
        from exllamav3 import ArgmaxSampler, Job

        first: dict[int, float] = {}
        t0 = time.perf_counter()
        for ids in prompts:
            job = Job(input_ids=torch.tensor([ids]), max_new_tokens=new, sampler=ArgmaxSampler(), stop_conditions=[])
            self.generator.enqueue(job)
        tokens = 0
        last = t0
        got: list[int] = []
        with torch.inference_mode():
            while self.generator.num_remaining_jobs():
                for r in self.generator.iterate():
                    t = r.get("token_ids")
                    if t is not None and t.numel():
                        now = time.perf_counter()
                        tokens += t.numel()
                        first.setdefault(id(r["job"]), now - t0)
                        last = now
                        got += t.flatten().tolist()
                    if r.get("eos"):
                        self.last = {k: r[k] for k in ("accepted_draft_tokens", "rejected_draft_tokens") if k in r}
        self.last["token_ids"] = got
        wall = time.perf_counter() - t0
        out = {"tokens": tokens, "wall": wall, "tps": tokens / wall, "ttft": statistics.median(first.values())}
        if len(prompts) == 1:
            f = next(iter(first.values())) + t0
            out["decode_tok_s"] = (tokens - 1) / (last - f) if last > f else float("nan")
        return out

    def threads(self, prompts: list[list[int]], new: int) -> dict[str, float]:
        """Independent callers, exllamav3's objects only: a thread per prompt builds its Job and hands it to this
        thread's iterate() loop (as a server's worker threads would); aggregate tok/s, median TTFT from each
        caller's start."""
        import torch
        from exllamav3 import ArgmaxSampler, Job

        lock, inbox, started, first = threading.Lock(), [], {}, {}
        done = threading.Semaphore(0)

        def call(ids: list[int]) -> None:
            t = time.perf_counter()
            job = Job(input_ids=torch.tensor([ids]), max_new_tokens=new, sampler=ArgmaxSampler(), stop_conditions=[])
            started[id(job)] = t
            with lock:
                inbox.append(job)
            done.acquire()  # until its last token

        t0 = time.perf_counter()
        callers = [threading.Thread(target=call, args=(ids,)) for ids in prompts]
        for c in callers:
            c.start()
        tokens = ended = 0
        with torch.inference_mode():
            while ended < len(prompts):
                with lock:
                    taken = inbox[:]
                    inbox.clear()
                for job in taken:
                    self.generator.enqueue(job)
                if not self.generator.num_remaining_jobs():
                    time.sleep(0.0002)
                    continue
                for r in self.generator.iterate():
                    t = r.get("token_ids")
                    if t is not None and t.numel():
                        tokens += t.numel()
                        first.setdefault(id(r["job"]), time.perf_counter() - started[id(r["job"])])
                    if r.get("eos"):
                        ended += 1
                        done.release()
        for c in callers:
            c.join()
        wall = time.perf_counter() - t0
        return {"tokens": tokens, "wall": wall, "tps": tokens / wall, "ttft": statistics.median(first.values())}

    def async_jobs(self, prompts: list[list[int]], new: int) -> dict[str, float]:
        """Independent async callers through exllamav3's own AsyncGenerator loop (TabbyAPI's way), over this
        generator: an AsyncJob per prompt, gathered."""
        import asyncio

        import torch
        from exllamav3 import ArgmaxSampler, AsyncGenerator, AsyncJob

        async def run() -> dict[str, float]:
            ag = AsyncGenerator.__new__(AsyncGenerator)  # its __init__ would build a second Generator on the cache
            ag.generator, ag.jobs, ag.error = self.generator, {}, None
            ag.condition = asyncio.Condition()
            ag.iteration_task = asyncio.create_task(ag._run_iteration())

            async def one(ids: list[int]) -> tuple[int, float]:
                t, n, ttft = time.perf_counter(), 0, float("nan")
                job = AsyncJob(
                    ag, input_ids=torch.tensor([ids]), max_new_tokens=new, sampler=ArgmaxSampler(), stop_conditions=[]
                )
                async for r in job:
                    ids_ = r.get("token_ids")
                    if ids_ is not None and ids_.numel():
                        if n == 0:
                            ttft = time.perf_counter() - t
                        n += ids_.numel()
                return n, ttft

            t0 = time.perf_counter()
            got = await asyncio.gather(*(one(ids) for ids in prompts))
            wall = time.perf_counter() - t0
            ag.iteration_task.cancel()
            try:
                await ag.iteration_task
            except asyncio.CancelledError:
                pass
            tokens = sum(n for n, _ in got)
            return {"tokens": tokens, "wall": wall, "tps": tokens / wall, "ttft": statistics.median(t for _, t in got)}

        with torch.inference_mode():
            return asyncio.run(run())

    def close(self) -> None:
        import gc

        import torch

        self.generator.close()
        if self.draft is not None:
            self.draft.unload()
        self.model.unload()
        gc.collect()
        torch.cuda.empty_cache()


class Results:
    """A benchmark's JSON results (rows of median/min/max summaries, and notes), rewritten after every row."""

    def __init__(self, file_name: str) -> None:
        self.file_name = file_name
        self.data: dict[str, Any] = {"rows": {}, "notes": {}}

    def _write(self, out: Path) -> None:
        (out / self.file_name).write_text(json.dumps(self.data, indent=1))

    def record(self, out: Path, section: str, name: str, runs: list[dict[str, float]]) -> None:
        row = {k: summary([r[k] for r in runs]) for k in runs[0]}
        self.data["rows"].setdefault(section, {})[name] = row
        self.data.setdefault("runs", {}).setdefault(section, {})[name] = runs
        self._write(out)
        cells = ", ".join(f"{k} {v['median']:.3f} [{v['min']:.3f}..{v['max']:.3f}]" for k, v in row.items())
        print(f"[{section}] {name}: {cells}", flush=True)

    def ratios(
        self, out: Path, section: str, pairs: list[tuple[str, str]], key: str = "tok_s", more: tuple[str, ...] = ()
    ) -> None:
        """Paired ratios, repetition by repetition (rows taken in one interleaved run): ``ours / raw`` of ``key``
        (and TTFT, and the ``more`` keys both rows have), summarized; on a noisy machine the ratio within a
        repetition is steadier than a ratio of medians."""
        runs = self.data["runs"][section]
        for ours, raw in pairs:
            for k in (key, "ttft_s", *more):
                if k not in runs[ours][0] or k not in runs[raw][0]:
                    continue
                xs = [a[k] / b[k] for a, b in zip(runs[ours], runs[raw]) if b[k]]
                name = f"{ours} / {raw}"
                self.data.setdefault("ratios", {}).setdefault(section, {}).setdefault(name, {})[k] = summary(xs)
                v = summary(xs)
                print(f"[{section}] {k} ratio {name}: {v['median']:.3f} [{v['min']:.3f}..{v['max']:.3f}]", flush=True)
        self._write(out)

    def note(self, out: Path, key: str, value: Any) -> None:
        self.data["notes"][key] = value
        self._write(out)
        print(f"note {key}: {value}", flush=True)


def exl3_model(results: Results, out: Path) -> Path:
    """A 1B-class Llama shape quantized to 4-bit EXL3 by exllamav3's own converter (once per machine, ~90 s)."""
    from fixture_models import Shape, convert_exl3, make_llama

    src, model = Path("/tmp/models/llama1b-fp16"), Path("/tmp/models/llama1b-exl3")
    if not (model / ".complete").exists():
        shape = Shape(hidden=2048, layers=16, heads=16, kv_heads=8, inter=5632, vocab=32000, context=4096)
        make_llama(src, shape, seed=8)
        results.note(out, "exl3_convert_seconds", round(convert_exl3(src, model, bits=4), 1))
        (model / ".complete").write_text("1")
    return model


def profile(pids: dict[str, int], seconds: float, out: Path, gil: bool = False) -> dict[str, Any]:
    """py-spy (100 Hz) on each named process for ``seconds``: per thread, its samples, the share of them in its 12
    commonest innermost frames (``leaves``) and the share in which each of its 30 commonest functions was anywhere on
    the stack (``inclusive``: where a step's time goes, callees included) (``{"error"}`` without py-spy).
    ``gil=False``: every thread, idle ones too (the share in which a thread ran on a CPU); ``gil=True``: only the
    thread holding the GIL at each sample (who takes it from whom). Threads whose names differ only in numbers (64
    reader threads) are counted as one."""
    import re
    import shutil
    import subprocess

    spy = shutil.which("py-spy") or "/tmp/site/bin/py-spy"
    if not Path(spy).exists():
        return {"error": "py-spy is not installed"}
    procs = {}
    for name, pid in pids.items():
        cmd = [spy, "record", "-p", str(pid), "-r", "100", "-d", str(int(seconds)), "--threads"]
        cmd += ["--gil" if gil else "--idle", "--nonblocking", "-f", "raw", "-o", str(out / f"pyspy_{name}.txt")]
        procs[name] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    report: dict[str, Any] = {}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=seconds + 60)
        path = out / f"pyspy_{name}.txt"
        if not path.exists():
            report[name] = {"error": err[-300:]}
            continue
        threads: dict[str, dict[str, Any]] = {}
        for line in path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            frames = stack.split(";")
            t = threads.setdefault(re.sub(r"\d+", "N", frames[0]), {"samples": 0, "leaves": {}, "inclusive": {}})
            t["samples"] += int(count)
            leaf = frames[-1].split(" (")[0]
            t["leaves"][leaf] = t["leaves"].get(leaf, 0) + int(count)
            for fn in {re.sub(r" \((?:.*/)?([^/]*?)(:\d+)?\)$", r" (\1)", f) for f in frames[1:]}:  # once per stack
                t["inclusive"][fn] = t["inclusive"].get(fn, 0) + int(count)
        for t in threads.values():
            for key, keep in (("leaves", 12), ("inclusive", 30)):
                top = sorted(t[key].items(), key=lambda kv: -kv[1])[:keep]
                t[key] = {k: round(v / t["samples"], 3) for k, v in top}
        report[name] = threads
        path.unlink()
    return report


def summary(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def parser(doc: str | None) -> argparse.ArgumentParser:
    """The options every GPU benchmark takes (``--out``, ``--reps``, ``--new``); NVLink multicast stays off."""
    os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"})
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--new", type=int, default=128)
    return ap


class GcPauses:
    """Python's garbage collections, timed (``gc.callbacks``): a collection holds the GIL that the driver needs."""

    def __init__(self) -> None:
        self.seconds, self.full, self._t = 0.0, 0, 0.0
        gc.callbacks.append(self._tick)

    def _tick(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t
            self.full += info.get("generation") == 2


class IterateTimer:
    """exllamav3's ``Generator.iterate()``, timed wherever it is called from (the batch16 and profile sections)."""

    def __init__(self, generator: Any, pauses: GcPauses | None = None) -> None:
        self.seconds, self.steps = 0.0, 0
        self.pauses = pauses
        inner = generator.iterate

        self.first: tuple[float, float] | None = None  # the first iterate() of a row: when it began, how long

        def iterate() -> Any:
            t = time.perf_counter()
            try:
                return inner()
            finally:
                self.seconds += time.perf_counter() - t
                self.steps += 1
                if self.first is None:
                    self.first = (t, time.perf_counter() - t)

        generator.iterate = iterate  # the instance attribute shadows the method

    def per_step(self, run: Callable[[], dict[str, float]]) -> Callable[[], dict[str, float]]:
        """``run``'s row, with its number of steps, the mean ms per step spent in ``iterate()`` and outside it,
        and the garbage collections' pauses during it (all of them, and how many were full collections)."""

        def go() -> dict[str, float]:
            s0, n0 = self.seconds, self.steps
            g0, f0 = (self.pauses.seconds, self.pauses.full) if self.pauses else (0.0, 0)
            self.first = None
            t0 = time.perf_counter()
            row = run()
            wall, n = time.perf_counter() - t0, max(1, self.steps - n0)
            inside = self.seconds - s0
            out = {**row, "steps": n, "iterate_ms": 1000 * inside / n, "outside_ms": 1000 * (wall - inside) / n}
            if self.first is not None:  # from the row's start to its first step, and that step's length
                out.update(first_step_at_ms=1000 * (self.first[0] - t0), first_step_ms=1000 * self.first[1])
            if self.pauses:
                out.update(gc_ms=1000 * (self.pauses.seconds - g0), gc_full=self.pauses.full - f0)
            return out

        return go


def interleave(results: Results, out: Path, section: str, paths: dict[str, Callable[[], Any]], reps: int) -> None:
    """Every path once to warm up, then ``reps`` rounds of all of them, each round starting one path later (no
    path always runs first or right after the same one); each path's runs recorded in ``results``."""
    for f in paths.values():  # warm-up
        f()
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in paths}
    names = list(paths)
    for rep in range(reps):
        for k in names[rep % len(names) :] + names[: rep % len(names)]:
            runs[k].append(paths[k]())
    for k, rs in runs.items():
        results.record(out, section, k, rs)
