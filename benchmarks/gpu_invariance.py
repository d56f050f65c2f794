"""Does a request's output depend on what else runs? 8 probe requests through the public API, in every situation.

For each model and each decode mode (exllamav3's own loop, ``decode="fast"`` as users get it, and
``deterministic=True``), through ``ExLlamaRuntime`` (what every door calls), 8 probe prompts of ``--prompt`` random
token ids, ``--new`` tokens each, greedy and seeded sampled (temperature 0.8, top-p 0.95, a seed per probe):

* ``alone``: each probe by itself, one after another (the reference); ``alone again``: the same once more (its
  prompt now in the prefix cache);
* ``in 16`` / ``in 64``: the probes inside one batch with 8 / 56 fresh prompts, at scattered positions;
* ``reversed``: the 8 probes handed over together in reverse order;
* ``after history``: a second probe set, run alone after 8 other prompts that share each probe's first page
  (256 tokens) and the first half of the rest (a partial second page, which exllamav3 copies from a cached page
  whose first tokens match) were prefilled, against the same probes run alone on a fresh runtime;
* ``next turn``: a chat's next turn: 8 prompts of 500 tokens answered (``--new`` tokens: the page holding the
  prompt's end is completed while decoding), then each prompt + its answer + 40 more tokens, against the same
  next-turn prompts run alone on a fresh runtime.

Each cell counts the probes whose tokens equal their ``alone`` tokens (of 8); ``vs own loop`` counts the greedy
probes equal to exllamav3's own loop in the same situation. ``first token ms`` is the time to the first token of 8
prompts of ``--prefill-prompt`` random tokens on a fresh runtime (the median; each prompt cold, after one untimed
prompt): the cost of ``deterministic=True``'s prefill (2048-token chunks from position 0) against the chunks of the
others.

    python benchmarks/gpu_invariance.py --out DIR [--models exl3,fp16] [--modes own,fast,deterministic,pinned]
    python benchmarks/gpu_invariance.py --backend transformers --model-dir DIR --prompt 300 --new 4  # CPU check
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Results, exl3_model, parser, summary  # noqa: E402

RESULTS = Results("gpu_invariance.json")
MODES = {
    "own": {"decode": "exllamav3"},
    "fast": {},
    "deterministic": {"deterministic": True},
    "pinned": {"deterministic": True},
}
"""Load options of each decode mode (``fast``: the defaults users get; ``pinned``: ``deterministic=True`` with its
pinned strategy, fast/pinned.py, chosen by flipping ``fast/deterministic.py`` STRATEGY for the run)."""


def run(model: Path, mode: str, args: Any) -> dict[str, Any]:
    """:func:`run_mode` of ``mode``, with ``deterministic=True``'s strategy set for it (rows apart unless pinned)."""
    from exllama_integrations.backends.exllamav3.fast import deterministic as det

    before = det.STRATEGY
    det.STRATEGY = det.PINNED if mode == "pinned" else det.ROWS_APART
    try:
        return run_mode(model, MODES[mode], args)
    finally:
        det.STRATEGY = before


def prompts(seed: int, n: int, length: int, vocab: int = 32000) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n, length), generator=g).tolist()


def tokens(results: list[Any]) -> list[list[int]]:
    return [list(r.token_ids) for r in results]


def run_mode(model: Path, options: dict[str, Any], args: Any) -> dict[str, Any]:  # noqa: C901
    """Every situation for one model and mode; the tokens of each, greedy and sampled."""
    from exllama_integrations import ExLlamaRuntime

    greedy = {"temperature": 0, "max_new_tokens": args.new, "ignore_eos": True}
    sampled = {"temperature": 0.8, "top_p": 0.95, "max_new_tokens": args.new, "ignore_eos": True}
    a = prompts(1, 8, args.prompt)
    fill = prompts(2, 56, args.prompt)
    b = prompts(3, 8, args.prompt)
    shared = 256 + (args.prompt - 256) // 2  # the first page and half of a partial second page
    history = [p[:shared] + q[: args.prompt - 256] for p, q in zip(b, prompts(4, 8, args.prompt))]
    turns = prompts(5, 8, 500)  # + --new tokens: the page holding the prompt's end completes while decoding
    more = prompts(6, 8, 40)
    at16 = [0, 2, 5, 6, 9, 11, 12, 15]  # where the probes sit among the fillers
    at64 = [1, 9, 17, 30, 33, 47, 50, 63]

    def mixed(probes: list[list[int]], fillers: list[list[int]], at: list[int]) -> list[list[int]]:
        out, it = [], iter(fillers)
        for i in range(len(at) + len(fillers)):
            out.append(probes[at.index(i)] if i in at else next(it))
        return out

    out: dict[str, Any] = {"greedy": {}, "sampled": {}}
    t0 = time.perf_counter()
    load = {"cache_size": 65536, **options} if args.backend == "exllamav3" else {}
    with ExLlamaRuntime(model, args.backend, **load) as rt:
        for kind, kw in (("greedy", greedy), ("sampled", sampled)):
            seeds = [{"seed": 1000 + i} if kind == "sampled" else {} for i in range(8)]
            got = out[kind]
            got["alone"] = [list(rt.generate(p, **kw, **s).token_ids) for p, s in zip(a, seeds)]
            got["alone again"] = [list(rt.generate(p, **kw, **s).token_ids) for p, s in zip(a, seeds)]
            if kind == "sampled":  # each probe keeps its seed wherever it sits (a request per prompt)
                from exllama_integrations import GenerationRequest, GenerationSettings

                def reqs(ps: list[list[int]], probe_seed: dict[int, int], kw: dict[str, Any] = kw) -> list[Any]:
                    return [
                        GenerationRequest(tuple(p), GenerationSettings(**kw, seed=probe_seed.get(i, 7 + i)))
                        for i, p in enumerate(ps)
                    ]

                r16 = rt.batch(reqs(mixed(a, fill[:8], at16), {at16[i]: 1000 + i for i in range(8)}))
                got["in 16"] = [list(r16[at16[i]].token_ids) for i in range(8)]
                r64 = rt.batch(reqs(mixed(a, fill, at64), {at64[i]: 1000 + i for i in range(8)}))
                got["in 64"] = [list(r64[at64[i]].token_ids) for i in range(8)]
                rr = rt.batch(reqs(a[::-1], {7 - i: 1000 + i for i in range(8)}))
                got["reversed"] = [list(rr[7 - i].token_ids) for i in range(8)]
            else:
                r16 = rt.batch(mixed(a, fill[:8], at16), **kw)
                got["in 16"] = [list(r16[at16[i]].token_ids) for i in range(8)]
                r64 = rt.batch(mixed(a, fill, at64), **kw)
                got["in 64"] = [list(r64[at64[i]].token_ids) for i in range(8)]
                rr = rt.batch(a[::-1], **kw)
                got["reversed"] = [list(r.token_ids) for r in rr[::-1]]
        rt.batch(history, **greedy)  # b's first page and part of its second, prefilled by other requests
        out["greedy"]["after history"] = [list(rt.generate(p, **greedy).token_ids) for p in b]
        answers = [list(rt.generate(p, **greedy).token_ids) for p in turns]
        nxt = [p + a + m for p, a, m in zip(turns, answers, more)]
        out["greedy"]["next turn"] = [list(rt.generate(p, **greedy).token_ids) for p in nxt]
        report = rt.diagnostics().get("fast_decode")
        out["report"] = report.report() if report is not None else None
    with ExLlamaRuntime(model, args.backend, **load) as fresh:
        out["first token"] = first_token_ms(fresh, args)
        out["greedy"]["b alone, fresh runtime"] = [list(fresh.generate(p, **greedy).token_ids) for p in b]
        out["greedy"]["next turn, fresh runtime"] = [list(fresh.generate(p, **greedy).token_ids) for p in nxt]
    out["seconds"] = round(time.perf_counter() - t0, 1)
    out["prompt_tokens"] = args.prefill_prompt
    return out


def first_token_ms(rt: Any, args: Any) -> dict[str, float]:
    """Milliseconds to the first token of 8 cold prompts of ``--prefill-prompt`` random tokens (one untimed first)."""
    cold = prompts(7, 9, args.prefill_prompt)
    one = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}
    rt.generate(cold[0], **one)  # kernels, graphs and allocations of the first prompt: not timed
    times = []
    for p in cold[1:]:
        t = time.perf_counter()
        rt.generate(p, **one)
        times.append((time.perf_counter() - t) * 1000)
    return {k: round(v, 2) for k, v in summary(times).items()}


def table(name: str, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per mode: probes (of 8) equal to their ``alone`` tokens in each situation; greedy also vs the own loop."""
    rows: dict[str, Any] = {}
    own = runs.get("own")
    for mode, got in runs.items():
        row: dict[str, Any] = {}
        for kind in ("greedy", "sampled"):
            ref = got[kind]["alone"]
            for situation in ("alone again", "in 16", "in 64", "reversed"):
                row[f"{kind}: {situation}"] = sum(x == y for x, y in zip(got[kind][situation], ref))
        hist = got["greedy"]
        row["greedy: after history"] = sum(
            x == y for x, y in zip(hist["after history"], hist["b alone, fresh runtime"])
        )
        if "next turn" in hist:  # (runs before the next-turn row have none)
            row["greedy: next turn"] = sum(x == y for x, y in zip(hist["next turn"], hist["next turn, fresh runtime"]))
        if "first token" in got:
            key = f"first token ms, {got['prompt_tokens']}-token prompt, cold (median of 8)"
            row[key] = got["first token"]["median"]
        if own is not None and mode != "own":
            for situation in ("alone", "in 16", "in 64", "reversed"):
                row[f"greedy {situation} vs own loop"] = sum(
                    x == y for x, y in zip(got["greedy"][situation], own["greedy"][situation])
                )
        row["seconds"] = got["seconds"]
        rows[mode] = row
        print(f"[invariance] {name} {mode}: {row}", flush=True)
    return rows


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--models", default="exl3,fp16")
    ap.add_argument("--modes", default="own,fast,deterministic")
    ap.add_argument("--prompt", type=int, default=300, help="tokens per prompt (> 256: a page to share)")
    ap.add_argument("--prefill-prompt", type=int, default=3584, help="tokens of each prompt whose first token is timed")
    ap.add_argument("--backend", default="exllamav3", help="transformers: a CPU check of the script (--model-dir)")
    ap.add_argument("--model-dir", type=Path, default=None, help="with --backend transformers: the model")
    ap.set_defaults(new=64)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    if args.backend != "exllamav3":
        paths = {"cpu": args.model_dir}
        args.models = "cpu"
    else:
        RESULTS.note(args.out, "gpu", torch.cuda.get_device_name(0))
        from importlib.metadata import version

        RESULTS.note(args.out, "exllamav3", version("exllamav3"))
        paths = {"exl3": exl3_model(RESULTS, args.out)}
        paths["fp16"] = Path("/tmp/models/llama1b-fp16")  # the same model before conversion (exl3_model built it)
    for name in args.models.split(","):
        runs = {}
        for mode in args.modes.split(","):
            try:
                runs[mode] = (
                    run(paths[name], mode, args)
                    if args.backend == "exllamav3"
                    else run_mode(paths[name], MODES[mode], args)
                )
            except Exception as e:  # noqa: BLE001 - recorded, the other modes go on
                RESULTS.note(args.out, f"{name} {mode} failed", f"{type(e).__name__}: {e}")
                continue
            RESULTS.note(args.out, f"{name} {mode} tokens", runs[mode])
            torch.cuda.empty_cache()
        RESULTS.note(args.out, f"table {name}", table(name, runs))


if __name__ == "__main__":
    main()
