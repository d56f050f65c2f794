"""MTP drafting (``draft="mtp"``) on the GPU, one stream, beside exllamav3's own loop with the same MTP drafter.

The checkpoint is built here so that acceptance is known (``tests/mtp_models.py``): a Qwen3.5-shaped model (24 Gated
DeltaNet and 8 attention layers, hidden 2560, Qwen3.5's 248,320-token vocabulary, 4.8B parameters in fp16) whose
layers all have zero output projections, so greedy decoding counts upward from the prompt's last token; its MTP head
is built the same way and drafts every token right ("perfect"), or has its ``mtp.fc`` perturbed so that, over this
run's own tokens, ``--target`` (0.70) of the drafted tokens are accepted by exllamav3's accounting ("mix"; the
perturbation's size is calibrated when the checkpoint is built). Built from safetensors directly (the GPU machine's
transformers lacks Qwen3.5): about 10 GB written, one trunk shared by both variants.

For each acceptance level, these rows run interleaved (``--reps`` rounds, each starting one row later, after one
warm-up each), greedy, ``--new`` tokens, ``ignore_eos``; medians [min..max] and paired ratios per round:

* raw exllamav3 Job loop, no drafting / with its MTP drafter (``Model.from_config(config, component="mtp")`` and a
  draft cache, as its ``model_init --mtp`` and TabbyAPI's ``draft_mode: mtp`` build it);
* ``ExLlamaLLM.stream()`` without drafting / with ``draft="mtp"`` (the public API);
* served: ``exllama-integrations serve --draft mtp``, one streaming ``/v1/completions`` client;
* with ``--jobs 16,64``: N jobs at once, ``ExLlamaRuntime.batch()`` with and without ``draft="mtp"`` and the raw loop
  with its MTP drafter, aggregate tok/s, fresh prompts each run (the prompt plus a running number: each job counts
  up from its own last token; acceptance is calibrated on ``PROMPT``'s chain only, so the mixed level's rate varies
  by job), greedy tokens of the drafted batch checked against the undrafted one on the same prompts.

Notes: greedy tokens of every row (in process, raw, served) against the counting chain and each other (asserted:
the run exits 1 if any differ), acceptance predicted from the checkpoint, reported by raw exllamav3 and by
``diagnostics()["drafting"]``, the ratio ``draft="mtp"`` / no drafting against its target (>= 1.8x perfect,
>= 1.4x mix), and each phase's seconds.

    python benchmarks/gpu_mtp.py --out DIR [--reps 5] [--new 128] [--shape bench] [--levels perfect,mix] [--jobs 16,64]
    python benchmarks/gpu_mtp.py --prepare-only --shape tiny --out DIR    # the checkpoints and predictions, on CPU
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RawExLlamaV3, Results, free_port, interleave, parser, public_stream, wait_up  # noqa: E402
from _loadgen import run_streams  # noqa: E402
from mtp_models import (  # noqa: E402
    BENCH,
    GPU_TEST,
    TINY,
    Probe,
    QwenShape,
    calibrate,
    make_trunk,
    make_variant,
    window_acceptance,
)

RESULTS = Results("gpu_mtp.json")
record, note = RESULTS.record, RESULTS.note
SHAPES = {"bench": BENCH, "test": GPU_TEST, "tiny": TINY}
PROMPT = "the quick brown fox jumps over the lazy dog while other animals watch it"
"""57 tokens: with up to 190 new ones, prompt and output stay inside the first 256-token page, short of the page
boundary where exllamav3 stashes a recurrent checkpoint (which ends a drafted window early, off the prediction)."""
TARGETS = {"perfect": 1.8, "mix": 1.4}
"""``draft="mtp"`` / no drafting, one stream on the H200 (issue 48)."""
OURS, OURS_MTP = "ExLlamaLLM.stream(), no drafting", "ExLlamaLLM.stream(), draft='mtp'"
RAW, RAW_MTP = "raw exllamav3 Job loop, no drafting", "raw exllamav3 Job loop, its MTP drafter"
SERVED = "served (serve --draft mtp): one streaming client"


def prepare(root: Path, shape: QwenShape, new: int, window: int, target: float, device: str) -> dict[str, Any]:
    """Build the trunk and its perfect and mixed MTP variants once (kept while the inputs are the same); the mixed
    head calibrated to ``target``; what each is predicted to get accepted over this run's tokens."""
    from tokenizers import Tokenizer

    stamp = root / "fixture.json"
    want = {"shape": dataclasses.asdict(shape), "new": new, "window": window, "target": target, "prompt": PROMPT}
    if stamp.exists() and json.loads(stamp.read_text()).get("inputs") == want:
        return dict(json.loads(stamp.read_text()))
    t0 = time.perf_counter()
    trunk = make_trunk(root / "trunk", shape, device=device)
    start = Tokenizer.from_file(str(trunk / "tokenizer.json")).encode(PROMPT).ids[-1]
    probe = Probe(trunk, shape, device=device)
    sigma, mixed = calibrate(probe, start, new, window, target)
    tokens = list(range(start, start + new + window + 1))
    right = dict(zip(tokens, probe.right(tokens, 0.0)))
    accepted, rejected = window_acceptance(lambda t: right.get(t, False), start, new, window)
    del probe  # its fp32 embedding and LM head (5 GB of the bench shape's)
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()
    levels = {}
    for name, s, rate in (("perfect", 0.0, accepted / (accepted + rejected)), ("mix", sigma, mixed)):
        levels[name] = {"dir": str(make_variant(trunk, root / name, shape, s, device=device)), "sigma": s}
        levels[name]["predicted_acceptance"] = round(rate, 4)
    info = {"inputs": want, "start": start, "levels": levels, "build_seconds": round(time.perf_counter() - t0, 1)}
    stamp.write_text(json.dumps(info, indent=1))
    return info


def start_server(model: Path, window: int, cache: int, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``exllama-integrations serve MODEL --draft mtp`` on a free port of 127.0.0.1 (its output in ``log``)."""
    port = free_port()
    cmd = [sys.executable, "-m", "exllama_integrations", "serve", str(model), "--backend", "exllamav3"]
    cmd += ["--port", str(port), "--draft", "mtp", "--option", f"num_draft_tokens={window}"]
    cmd += ["--option", f"cache_size={cache}"]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def ours(llm: Any) -> Callable[[], dict[str, float]]:
    def run() -> dict[str, float]:
        r = public_stream(llm, PROMPT, ignore_eos=True)
        return {"tok_s": r["decode_tok_s"], "ttft_s": r["ttft"]}

    return run


def raw(loop: RawExLlamaV3, ids: list[int], new: int) -> Callable[[], dict[str, float]]:
    def run() -> dict[str, float]:
        r = loop.jobs([ids], new)
        return {"tok_s": r["decode_tok_s"], "ttft_s": r["ttft"]}

    return run


class Batches:
    """Rows of N jobs at once. A row's k-th run takes the k-th set of N fresh prompts (``PROMPT`` and a running
    number); :func:`interleave` runs every row equally often, so the k-th runs of two rows share their prompts and
    their greedy tokens are compared (drafted against undrafted)."""

    def __init__(self, n: int, new: int) -> None:
        self.n, self.new = n, new
        self.calls: dict[str, int] = {}
        self.tokens: dict[tuple[str, int], list[list[int]]] = {}
        self.differ = 0
        """Runs where the drafted batch's greedy tokens differed from the undrafted one's on the same prompts."""

    def _prompts(self, key: str) -> tuple[int, list[str]]:
        k = self.calls[key] = self.calls.get(key, 0) + 1
        return k, [f"{PROMPT} {k * 1000 + i}" for i in range(self.n)]

    def ours(self, rt: Any, key: str, twin: str) -> Callable[[], dict[str, float]]:
        def run() -> dict[str, float]:
            k, prompts = self._prompts(key)
            t0 = time.perf_counter()
            results = rt.batch(prompts, temperature=0, max_new_tokens=self.new, ignore_eos=True)
            wall = time.perf_counter() - t0
            tokens = self.tokens[(key, k)] = [list(r.token_ids) for r in results]
            other = self.tokens.get((twin, k))
            if other is not None and other != tokens:
                self.differ += 1
            return {"tok_s": sum(map(len, tokens)) / wall, "wall_s": wall}

        return run

    def raw(self, loop: RawExLlamaV3, encode: Callable[[str], list[int]]) -> Callable[[], dict[str, float]]:
        def run() -> dict[str, float]:
            _, prompts = self._prompts("raw")
            r = loop.jobs([encode(p) for p in prompts], self.new)
            return {"tok_s": r["tps"], "wall_s": r["wall"]}

        return run


def served(url: str, new: int) -> Callable[[], dict[str, float]]:
    def run() -> dict[str, float]:
        p = run_streams(url, [PROMPT], new, time.time())
        return {"tok_s": (p["tokens"] - 1) / (p["end"] - p["start"] - p["ttfts"][0]), "ttft_s": p["ttfts"][0]}

    return run


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--root", type=Path, default=Path("/tmp/models/mtp"))
    ap.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    ap.add_argument("--levels", default="perfect,mix")
    ap.add_argument("--target", type=float, default=0.70, help="the mixed head's acceptance")
    ap.add_argument("--window", type=int, default=4, help="num_draft_tokens")
    ap.add_argument("--cache", type=int, default=4096, help="cache tokens of every row")
    ap.add_argument("--no-served", action="store_true")
    ap.add_argument("--jobs", default="", help="also N jobs at once, e.g. 16,64 (batch rows)")
    ap.add_argument("--draft-window", default="measured", choices=("measured", "fixed"), help="ours: draft_window")
    ap.add_argument("--no-stream", action="store_true", help="only the --jobs rows (not the one-stream ones)")
    ap.add_argument("--no-raw-batch", action="store_true", help="--jobs rows without raw exllamav3's drafting row")
    ap.add_argument("--prepare-only", action="store_true", help="build and calibrate the checkpoints, then stop")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = SHAPES[args.shape]
    fixture = prepare(args.root / args.shape, shape, args.new, args.window, args.target, device)
    note(args.out, "fixture", {**fixture, "shape": args.shape, "params": shape.params})
    if args.prepare_only:
        return
    run(args, fixture, shape)


def run(args: Any, fixture: dict[str, Any], shape: QwenShape) -> None:
    """Every row of every level (see the module docstring); exits 1 when a row's greedy tokens differ."""
    import torch

    from exllama_integrations import ExLlamaRuntime
    from exllama_integrations.runtime.remote import RemoteRuntime

    note(args.out, "gpu", torch.cuda.get_device_name(0))
    new, cache, window = args.new, args.cache, args.window
    greedy = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}
    base = Path(fixture["levels"]["perfect"]["dir"])
    t0 = time.perf_counter()
    rt_plain = ExLlamaRuntime(base, "exllamav3", cache_size=cache)
    raw_plain = RawExLlamaV3(base, cache_tokens=cache)
    note(args.out, "load_seconds: both rows without drafting", round(time.perf_counter() - t0, 1))
    ids = rt_plain.encode(PROMPT, add_special_tokens=True)
    chain = [(fixture["start"] + 1 + i) % shape.vocab for i in range(new)]
    want = list(rt_plain.generate(PROMPT, **greedy).token_ids)
    raw_plain.jobs([ids], new)
    differ = {"ours, no drafting": want != chain, "raw, no drafting": raw_plain.last["token_ids"] != chain}
    note(args.out, "greedy tokens count upward from the prompt's last token (the checkpoint's design)", want == chain)
    errors: dict[str, str] = {}
    for level in args.levels.split(","):
        spec = fixture["levels"][level]
        section = f"{level}: predicted acceptance {spec['predicted_acceptance']} (mtp.fc sigma {spec['sigma']:.3g})"
        model, server, rt, loop = Path(spec["dir"]), None, None, None
        try:
            t0 = time.perf_counter()
            if not args.no_served:
                server = start_server(model, window, cache, args.out / f"server_{level}.log")
            rt = ExLlamaRuntime(
                model,
                "exllamav3",
                cache_size=cache,
                draft="mtp",
                num_draft_tokens=window,
                draft_window=args.draft_window,
            )
            loop = RawExLlamaV3(model, cache_tokens=cache, mtp=True, num_draft_tokens=window)
            if server is not None:
                wait_up(server[1], server[0], 300)
            note(args.out, f"{level}: load_seconds (MTP rows, the server beside)", round(time.perf_counter() - t0, 1))
            note(args.out, f"{level}: model_info().details['drafting']", rt.model_info().details.get("drafting"))
            note(args.out, f"{level}: ours, draft_window", args.draft_window)
            got = list(rt.generate(PROMPT, **greedy).token_ids)
            loop.jobs([ids], new)
            differ[f"{level}: ours, draft='mtp'"] = got != want
            differ[f"{level}: raw, its MTP drafter"] = loop.last["token_ids"] != want
            if args.no_stream:
                batch_rows(args, rt, rt_plain, loop, level, differ)
                continue
            from exllama_integrations.langchain import ExLlamaLLM  # (the one-stream rows' public API: LangChain's)

            paths = {
                RAW: raw(raw_plain, ids, new),
                RAW_MTP: raw(loop, ids, new),
                OURS: ours(ExLlamaLLM(runtime=rt_plain, temperature=0, max_new_tokens=new)),
                OURS_MTP: ours(ExLlamaLLM(runtime=rt, temperature=0, max_new_tokens=new)),
            }
            if server is not None:
                remote = RemoteRuntime(server[1])
                differ[f"{level}: served, --draft mtp"] = list(remote.generate(PROMPT, **greedy).token_ids) != want
                remote.close()
                paths[SERVED] = served(server[1], new)
            interleave(RESULTS, args.out, section, paths, args.reps)
            pairs = [(OURS_MTP, OURS), (RAW_MTP, RAW), (OURS_MTP, RAW_MTP), (OURS, RAW)]
            RESULTS.ratios(args.out, section, pairs + ([(SERVED, OURS_MTP)] if server is not None else []))
            speedup = RESULTS.data["ratios"][section][f"{OURS_MTP} / {OURS}"]["tok_s"]["median"]
            note(args.out, f"{level}: draft='mtp' / no drafting, median of paired ratios", round(speedup, 3))
            note(args.out, f"{level}: target >= {TARGETS[level]}x met", speedup >= TARGETS[level])
            drafting = rt.diagnostics()["drafting"].report()
            note(args.out, f"{level}: acceptance, ours (diagnostics()['drafting'], every job)", drafting)
            raw_counts = {k: v for k, v in loop.last.items() if k != "token_ids"}
            note(args.out, f"{level}: acceptance, raw exllamav3 (its last job)", raw_counts)
            note(args.out, f"{level}: decode report, ours", rt.diagnostics()["fast_decode"].report())
            if rt.diagnostics().get("draft_window") is not None:
                note(args.out, f"{level}: draft windows chosen, ours", rt.diagnostics()["draft_window"].report())
            batch_rows(args, rt, rt_plain, loop, level, differ)
        except Exception as e:  # noqa: BLE001 - recorded; the next level still runs
            errors[level] = f"{type(e).__name__}: {e}"
            note(args.out, f"{level}: error", errors[level])
        finally:
            for obj in (rt, loop):
                if obj is not None:
                    obj.close()
            if server is not None:
                server[0].terminate()
                server[0].wait(60)
            torch.cuda.empty_cache()
    note(args.out, "greedy tokens differ from the counting chain or from no drafting", differ)
    rt_plain.close()
    raw_plain.close()
    if errors or any(differ.values()):
        sys.exit(1)


def batch_rows(args: Any, rt: Any, rt_plain: Any, loop: RawExLlamaV3, level: str, differ: dict[str, bool]) -> None:
    """The ``--jobs`` rows of one level: N jobs at once, drafted (ours and raw) and not, interleaved; with each
    section, the steps our drafting runtime ran parked (no drafter), as catch-ups and drafting (draft_window)."""
    for n in [int(j) for j in args.jobs.split(",") if j.strip()]:
        batches = Batches(n, args.new)
        bsec = f"{level}: {n} jobs at once"
        rows = {
            f"ExLlamaRuntime.batch({n}), no drafting": batches.ours(rt_plain, "plain", "mtp"),
            f"ExLlamaRuntime.batch({n}), draft='mtp'": batches.ours(rt, "mtp", "plain"),
        }
        if not args.no_raw_batch:
            rows[f"raw exllamav3, {n} jobs, its MTP drafter"] = batches.raw(
                loop, lambda p: rt_plain.encode(p, add_special_tokens=True)
            )
        parking = rt.diagnostics().get("mtp_parking")
        before = parking.report() if parking is not None else {}
        interleave(RESULTS, args.out, bsec, rows, args.reps)
        names = list(rows)
        RESULTS.ratios(args.out, bsec, [(names[1], names[0]), *([(names[1], names[2])] if len(names) > 2 else [])])
        ratio = RESULTS.data["ratios"][bsec][f"{names[1]} / {names[0]}"]["tok_s"]["median"]
        note(args.out, f"{bsec}: draft='mtp' / no drafting, median of paired ratios", round(ratio, 3))
        note(args.out, f"{bsec}: target >= 1.0x met", ratio >= 1.0)
        if parking is not None:  # this section's steps (its warm-up run included)
            after = parking.report()
            steps = {k: after[k] - before.get(k, 0) for k in after}
            note(args.out, f"{bsec}: steps of ours, parked (no drafter) / catch-up / drafting", steps)
        rule = rt.diagnostics().get("draft_window")
        if rule is not None:
            chosen = rule.report()
            note(args.out, f"{bsec}: draft windows chosen, ours", chosen)
            over = {k: r["exploring_share"] for k, r in chosen.items() if r["exploring_share"] > rule.explore_share}
            note(args.out, f"{bsec}: exploring_share <= {rule.explore_share} in every bucket met", over or True)
        graphs = rt.diagnostics()["fast_decode"].report().get("graphs", {})
        note(
            args.out,
            f"{bsec}: captured steps of the drafting runtime (parked, and exporting for the drafter)",
            {k: graphs.get(k) for k in ("replays", "shapes", "eager_forwards", "capture_failed")},
        )
        differ[f"{bsec}: draft='mtp' vs none, rounds whose tokens differ"] = batches.differ > 0


if __name__ == "__main__":
    main()
