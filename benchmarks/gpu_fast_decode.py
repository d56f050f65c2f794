"""exllamav3's decode step on the H200, raw and with ``decode="fast"`` (the batched sampler), on two models.

Models: a 1B-class Llama shape converted to 4-bit EXL3 (``_common.exl3_model``) and the Llama-2-7B shape in
fp16 (random weights from a seed). Prompts are fresh random ids (128 tokens) for every call, so no prefix is
reused.

* profile: raw exllamav3 at batch 1, 16 and 64: the wall time of a decode step (``iterate()``), the host time in
  ``Model.forward``, in the jobs' sampling (``Job.receive_logits``) and in their bookkeeping
  (``Job.receive_sample``), and torch.profiler's GPU-busy time over 16 steps (sum of kernel times / wall)
* greedy: the greedy tokens of exllamav3's own loop and of ``decode="fast"`` for ``--new`` steps at batch 1, 16
  and 64 (the same prompts; two generators on one model), compared token for token, with the logit margin of
  the first step where they part, if any
* sampled: the batched sampler against exllamav3's own ``ComboSampler`` on the same logits (``--draws`` draws
  per setting, chi-square over the tokens either drew at least 5 times in all)
* families: every family of the architecture matrix, its bf16 weights and its 4-bit EXL3 conversion, greedy
  tokens of ``decode="fast"`` against exllamav3's own loop at batch 1, 16 and 64 (as ``greedy``); with ``--fixtures
  DIR`` also the carried 2026 families (tests/gpu/build_family_fixtures.py; vocabulary 512)
* prefill: where the prompts' prefill goes: 64 jobs enqueued together, the first ``iterate()`` (64 x
  ``Model.prefill`` of 127 tokens, then the first decode step) timed with a synchronize, with exllamav3's choice of
  GEMM (its EXL3 kernel up to 144 rows) and with ``reconstruct`` forced (dequantize, then an fp16 GEMM); per call
  with a synchronize each; torch.profiler's kernel table (the 12 longest kernels) and GPU-busy share
* bench: 16 and 64 jobs enqueued together, raw vs ``decode="fast"`` (same generator type, two instances),
  interleaved, ``--reps`` rounds; tokens/s, ms per step, paired ratios (``--models hybrid,hybrid-exl3``: a ~1.5B
  Qwen3.5-shaped Gated DeltaNet hybrid, bf16 and converted to 4-bit EXL3; ``--models moe``: a Qwen3-MoE shape in
  4-bit EXL3, tests/moe_models.py, whose MoE layers are captured up to 32 rows and run eagerly above; ``--models
  rings``: GPT-OSS in 4-bit EXL3 with its sliding-window rings captured, ``rings-gemma4`` Gemma 4 bf16,
  tests/ring_models.py; ``--models mamba,mamba-exl3``: a Nemotron-H shape with Mamba-2 layers, bf16 and 4-bit EXL3,
  tests/mamba_models.py)

    python benchmarks/gpu_fast_decode.py --out DIR [--sections profile,greedy,families,sampled,bench]
        [--models exl3,fp16] [--no-sampler-alone]   (sections also: prefill)
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Results, exl3_model, parser  # noqa: E402
from _common import interleave as _interleave  # noqa: E402

from fixture_models import LLAMA2_7B, make_llama  # noqa: E402

RESULTS = Results("gpu_fast_decode.json")
record, note, ratios = RESULTS.record, RESULTS.note, RESULTS.ratios
BATCHES = (1, 16, 64)


class Prompts:
    """Fresh random prompts (ids 10..vocab-1), a new set for every call."""

    def __init__(self, vocab: int, tokens: int = 128) -> None:
        import torch

        self.vocab, self.tokens = vocab, tokens
        self.rng = torch.Generator().manual_seed(1234)

    def take(self, n: int, ragged: bool = False) -> list[list[int]]:
        """``n`` prompts of ``tokens`` ids (``ragged``: each of its own length, from half to 1.5x that)."""
        import torch

        if not ragged:
            return torch.randint(10, self.vocab, (n, self.tokens), generator=self.rng).tolist()
        lengths = torch.randint(self.tokens // 2, self.tokens * 3 // 2 + 1, (n,), generator=self.rng).tolist()
        return [torch.randint(10, self.vocab, (k,), generator=self.rng).tolist() for k in lengths]


def config_overlay(model_dir: Path) -> Any:
    """``model_dir`` with the config keys exllamav3 reads added (``patches.config_overrides``, as the runtime loads
    it): a temporary folder to read instead, or None when none are missing."""
    import json

    from exllama_integrations.backends.exllamav3 import patches

    overrides = patches.config_overrides(json.loads((model_dir / "config.json").read_text()))
    return patches.overlay(model_dir, overrides) if overrides else None


class Raw:
    """exllamav3 alone (Config -> Model -> Cache -> Tokenizer -> Generator) with our upstream fixes where one applies;
    ``fast``: the fast path on it."""

    def __init__(
        self,
        model_dir: Path,
        fast: bool,
        cache_tokens: int = 40960,
        model: Any = None,
        graphs: bool = True,
        ahead: bool = True,
        prefill: bool = False,
        deterministic: bool = False,
        strategy: str | None = None,
        det_chunk: int = 2048,
    ) -> None:
        from exllamav3 import Cache, Config, Generator, Model, Tokenizer

        from exllama_integrations.backends.exllamav3 import patches

        # our upstream fixes (patches.py), as the runtime applies them: none applies to the Llama shapes; a family
        # of the architecture matrix may need one (Qwen3-MoE's config key, Gemma 3's empty key prefix)
        self.overlay = config_overlay(model_dir)
        config = Config.from_directory(self.overlay.name if self.overlay else str(model_dir))
        self.model = model
        self.fixes: dict[str, int] = {}
        if model is None:
            self.model = Model.from_config(config)
            self.fixes = patches.apply(self.model)
        self.cache = Cache(self.model, max_num_tokens=cache_tokens)
        if model is None:
            self.model.load(progressbar=False)
        self.tokenizer = Tokenizer.from_config(config)
        # deterministic=True prefills in chunks of whole pages from position 0, the same while others decode
        # (max_chunk_size and shared_chunk_size equal), as the runtime does: 2048 (det_chunk), 256 for the one-page row
        chunks = {"max_chunk_size": det_chunk, "shared_chunk_size": det_chunk} if deterministic else {}
        self.generator = Generator(self.model, self.cache, self.tokenizer, max_batch_size=64, **chunks)
        self.fast = None
        if fast:
            from exllama_integrations.backends.exllamav3.fast import FastDecode

            self.fast = FastDecode(
                self.generator,
                graphs=graphs,
                ahead=ahead,
                prefill=prefill,
                deterministic=deterministic,
                recurrent=True,
                strategy=strategy,
            )
            assert self.fast.active, self.fast.report()
            if strategy is not None:  # the strategy asked for runs, or the row would measure the other one
                assert self.fast.strategy == strategy, self.fast.report()

    def enqueue(self, prompts: list[list[int]], new: int, sampler: Any = None, settings: Any = None) -> list[Any]:
        import torch
        from exllamav3 import ArgmaxSampler, Job

        jobs = []
        for ids in prompts:
            job = Job(
                input_ids=torch.tensor([ids]),
                max_new_tokens=new,
                sampler=sampler or ArgmaxSampler(),
                stop_conditions=[],
            )
            if self.fast is not None:
                from exllama_integrations.backends.exllamav3.fast.sampler import RowSettings

                self.fast.adopt(job, settings or RowSettings(greedy=True), len(ids))
            self.generator.enqueue(job)
            jobs.append(job)
        return jobs

    def run(self, prompts: list[list[int]], new: int) -> dict[str, Any]:
        """All prompts enqueued together, greedy: tokens per job, tok/s, ms per decode step."""
        import torch

        jobs = self.enqueue(prompts, new)
        out: dict[int, list[int]] = {id(j): [] for j in jobs}
        steps, t0, first = 0, time.perf_counter(), None
        with torch.inference_mode():
            while self.generator.num_remaining_jobs():
                for r in self.generator.iterate():
                    t = r.get("token_ids")
                    if t is not None and t.numel():
                        out[id(r["job"])] += t.flatten().tolist()
                        if first is None:
                            first = time.perf_counter()
                steps += 1
        wall = time.perf_counter() - t0
        tokens = sum(len(v) for v in out.values())
        decode = wall - ((first or t0) - t0)
        return {
            "tokens": [out[id(j)] for j in jobs],
            "tok_s": tokens / wall,
            "step_ms": 1000 * decode / max(1, steps - 1),
            "steps": steps,
        }

    def first_token(self, prompt: list[int]) -> dict[str, float]:
        """One cold prompt alone: milliseconds from its enqueue to its first token (prefill and the first step)."""
        import torch

        jobs = self.enqueue([prompt], 1)
        t0 = time.perf_counter()
        with torch.inference_mode():
            while self.generator.num_remaining_jobs():
                self.generator.iterate()
        assert jobs[0].new_tokens >= 1
        return {"first_token_ms": 1000 * (time.perf_counter() - t0)}

    def close(self) -> None:
        if self.fast is not None:
            self.fast.close()
        self.generator.close() if hasattr(self.generator, "close") else None
        self.cache = None


def load_models(args: Any) -> dict[str, Path]:
    models: dict[str, Path] = {}
    for name in [m for m in args.models.split(",") if m]:
        if name == "exl3":
            models[name] = exl3_model(RESULTS, args.out)
        elif name == "fp16":
            path = Path("/tmp/models/llama7b-fp16")
            if not (path / ".complete").exists():
                t0 = time.perf_counter()
                make_llama(path, LLAMA2_7B, seed=7)
                (path / ".complete").write_text("1")
                note(args.out, "fixture_seconds", round(time.perf_counter() - t0, 1))
            models[name] = path
        elif name in ("hybrid", "hybrid-exl3"):  # a ~1.5B Qwen3.5 shape: 18 Gated DeltaNet + 6 attention layers
            from mtp_models import HYBRID_1B, make_random

            from fixture_models import convert_exl3

            src = Path("/tmp/models/qwen35-hybrid-bf16")
            if not (src / ".complete").exists():
                make_random(src, HYBRID_1B, seed=9, device="cuda")
                (src / ".complete").write_text("1")
            path = src if name == "hybrid" else Path("/tmp/models/qwen35-hybrid-exl3")
            if not (path / ".complete").exists():
                note(args.out, "hybrid_exl3_convert_seconds", round(convert_exl3(src, path, bits=4), 1))
                (path / ".complete").write_text("1")
            models[name] = path
        elif name == "moe":  # a Qwen3-MoE shape in 4-bit EXL3 (tests/moe_models.py): 6 layers, 32 experts, top-8
            from moe_models import qwen3_moe_exl3

            models[name], took = qwen3_moe_exl3()
            for k, v in took.items():
                note(args.out, f"moe fixture {k}", v)
        elif name in ("rings", "rings-gemma4"):  # sliding-window rings (tests/ring_models.py): GPT-OSS 4-bit EXL3,
            from ring_models import gemma4_bf16, gpt_oss_exl3  # or Gemma 4 bf16

            models[name], took = (gpt_oss_exl3 if name == "rings" else gemma4_bf16)()
            for k, v in took.items():
                note(args.out, f"{name} fixture {k}", v)
        elif name in ("mamba", "mamba-exl3"):  # a Nemotron-H shape (tests/mamba_models.py): 7 Mamba-2 layers, bf16
            from mamba_models import nemotron_h_bf16, nemotron_h_exl3  # or 4-bit EXL3

            models[name], took = (nemotron_h_bf16 if name == "mamba" else nemotron_h_exl3)()
            for k, v in took.items():
                note(args.out, f"{name} fixture {k}", v)
    return models


def profile_steps(raw: Raw, batch: int, prompts: Prompts, steps: int = 32) -> dict[str, float]:
    """Decode steps of ``batch`` greedy jobs: wall, host time in forward / sampling / bookkeeping, GPU busy."""
    import torch
    from exllamav3 import Job
    from torch.profiler import ProfilerActivity, profile

    spent = {"forward": 0.0, "receive_logits": 0.0, "receive_sample": 0.0}
    originals = {"receive_logits": Job.receive_logits, "receive_sample": Job.receive_sample}

    def timed(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def go(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t

        return go

    forward = raw.model.forward
    raw.model.forward = timed("forward", forward)
    for name, f in originals.items():
        setattr(Job, name, timed(name, f))
    jobs = raw.enqueue(prompts.take(batch), 16 + 2 * steps + 16)
    try:
        with torch.inference_mode():
            while any(j.new_tokens < 2 for j in jobs):  # prefills done, first tokens out
                raw.generator.iterate()
            for _ in range(4):
                raw.generator.iterate()
            for k in spent:
                spent[k] = 0.0
            walls = []
            for _ in range(steps):
                t = time.perf_counter()
                raw.generator.iterate()
                walls.append(time.perf_counter() - t)
            host = {f"{k}_ms": 1000 * v / steps for k, v in spent.items()}
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                t = time.perf_counter()
                for _ in range(16):
                    raw.generator.iterate()
                torch.cuda.synchronize()
                wall16 = time.perf_counter() - t
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            busy = sum(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total for e in kernels)
            busy_s = busy / 1e6
    finally:
        raw.model.forward = forward
        for name, f in originals.items():
            setattr(Job, name, f)
        for j in jobs:
            raw.generator.cancel(j)
    step = statistics.median(walls)
    return {
        "step_ms": 1000 * step,
        "step_ms_min": 1000 * min(walls),
        "step_ms_max": 1000 * max(walls),
        **host,
        "gpu_busy_ms": 1000 * busy_s / 16,
        "gpu_busy_share": busy_s / wall16,
        "kernels_per_step": len(kernels) / 16,
        "profiled_step_ms": 1000 * wall16 / 16,
    }


def section_profile(args: Any, models: dict[str, Path]) -> None:
    import torch

    for name, path in models.items():
        for label, fast in (("raw exllamav3", False), ('decode="fast"', True)):
            raw = Raw(path, fast=fast)
            prompts = Prompts(32000)
            for batch in BATCHES:
                profile_steps(raw, batch, prompts, steps=8)  # warm-up: kernels, autotuning, captures at this batch
                record(args.out, f"profile {name}", f"{label}, batch {batch}", [profile_steps(raw, batch, prompts)])
            if raw.fast is not None:
                note(args.out, f"fast path report after the {name} profile", raw.fast.report())
            raw.close()
            del raw
            torch.cuda.empty_cache()


def compare(raw: Raw, fast: Raw, ps: list[list[int]], new: int) -> dict[str, Any]:
    """Greedy tokens of exllamav3's own loop and of ``decode="fast"`` on the same prompts, token for token (and the
    raw loop run again: it must repeat itself); where a job parts, the step and the raw loop's logit margin there."""
    a, b, again = raw.run(ps, new), fast.run(ps, new), raw.run(ps, new)
    parted = [i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y]
    row: dict[str, Any] = {
        "jobs": len(ps),
        "steps": new,
        "identical_jobs": len(ps) - len(parted),
        "tokens_compared": sum(len(x) for x in a["tokens"]),
        "raw_repeats_itself": again["tokens"] == a["tokens"],
    }
    partings = []
    for i in parted[:16]:  # where each parting job parts, and the raw model's logit margin there
        x, y = a["tokens"][i], b["tokens"][i]
        k = next(n for n, (s, t) in enumerate(zip(x, y)) if s != t)
        partings.append(
            {
                "job": i,
                "step": k,
                "raw_token": x[k],
                "fast_token": y[k],
                "logit_margin": margin(raw, ps[i] + x[:k], x[k], y[k]),
            }
        )
    if partings:
        row["partings"] = partings
        margins = [p["logit_margin"] for p in partings if isinstance(p["logit_margin"], float)]
        row["largest_margin"] = max(margins, default=None)
    return row


def section_greedy(args: Any, models: dict[str, Path]) -> None:
    import torch

    for name, path in models.items():
        raw = Raw(path, fast=False)
        # a model of its own: no state shared with the raw one; prompts prefilled job by job, as exllamav3 does (the
        # decode step alone is compared here; batched prefill in the prefill section)
        fast = Raw(path, fast=True, prefill=False)
        prompts = Prompts(32000)
        for batch in BATCHES:
            row = compare(raw, fast, prompts.take(batch), args.new)
            note(args.out, f"greedy {name} batch {batch}", row)
            print(f"[greedy] {name} batch {batch}: {row}", flush=True)
        fast.fast_report = fast.fast.report()  # type: ignore[union-attr]
        note(args.out, f"greedy {name} fast path report", fast.fast_report)
        fast.close()
        raw.close()
        del raw, fast
        torch.cuda.empty_cache()


def section_families(args: Any, models: dict[str, Path]) -> None:
    """Every family of the architecture matrix (tests/arch_models.py, the GPU width: hidden 1024, 8 layers, bf16
    weights), as built and converted to 4-bit EXL3 by exllamav3's own converter: greedy tokens of ``decode="fast"``
    against exllamav3's own loop at batch 1, 16 and 64 for ``--new`` steps. A family exllamav3 cannot load or
    convert is recorded as refused, with why."""
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from arch_models import ARCHS, make_arch

    from fixture_models import convert_exl3

    root = Path("/tmp/models/families")
    built: dict[str, Path] = {}
    # the 2026 families come built (tests/gpu/build_family_fixtures.py, carried): this machine's transformers lacks some
    carried = (
        {p.name: p for p in sorted(args.fixtures.iterdir()) if (p / "oracle.json").is_file()} if args.fixtures else {}
    )
    names = [*(n for n in ARCHS if n not in carried), *carried]
    wanted = [n for n in names if not args.families or n in args.families.split(",")]
    for i, name in ((i, n) for i, n in enumerate(names) if n in wanted):
        if name in carried:
            built[name] = carried[name]
            continue
        path = root / name
        if not (path / ".complete").exists():
            make_arch(name, path, size="gpu", seed=7 + i, device="cuda")
            (path / ".complete").write_text("1")
        built[name] = path
    torch.cuda.empty_cache()

    def convert(name: str) -> tuple[str, Path | str]:
        out = root / f"{name}-exl3"
        if (out / ".complete").exists():
            return name, out
        src = built[name]
        overlay = config_overlay(src)  # the converter reads config.json too: the same key fixes as loading (Raw)
        try:
            seconds = convert_exl3(Path(overlay.name) if overlay else src, out, bits=4, timeout=400)
        except Exception as e:  # noqa: BLE001 - recorded as the family's EXL3 row
            return name, f"{type(e).__name__}: {str(e)[-300:]}"
        finally:
            if overlay is not None:
                overlay.cleanup()
        (out / ".complete").write_text(f"{seconds:.1f}")
        return name, out

    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        converted = dict(pool.map(convert, list(built)))
    note(args.out, "families: EXL3 conversion seconds (4 at a time)", round(time.perf_counter() - t0, 1))
    for name in wanted:
        for kind, path in (("bf16", built[name]), ("exl3", converted[name])):
            key = f"family {name} {kind}"
            if not isinstance(path, Path):
                note(args.out, key, {"status": "not converted", "why": path})
                continue
            try:
                raw = Raw(path, fast=False, cache_tokens=20480)
                fast = Raw(path, fast=True, cache_tokens=20480, prefill=False)
            except Exception as e:  # noqa: BLE001 - a family exllamav3 does not load
                note(args.out, key, {"status": "refused by exllamav3", "why": f"{type(e).__name__}: {str(e)[:300]}"})
                torch.cuda.empty_cache()
                continue
            prompts = Prompts(vocab_size(path))
            rows = {}
            try:
                for batch in BATCHES:
                    rows[f"batch {batch}"] = compare(raw, fast, prompts.take(batch), args.new)
                report = fast.fast.report()  # type: ignore[union-attr]
                graphs = report["graphs"]
                rows["graphs"] = {k: graphs.get(k) for k in ("captured", "stands_aside", "shapes", "replays")}
                rows["batched_tokens"] = report["batched_tokens"]
                rows["upstream_fixes"] = {**raw.fixes, **({"config_keys": 1} if raw.overlay else {})}
                rows["identical"] = all(
                    r["identical_jobs"] == r["jobs"] for k, r in rows.items() if k.startswith("batch ")
                )
            except Exception as e:  # noqa: BLE001 - recorded, not hidden
                rows["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            note(args.out, key, rows)
            print(f"[families] {key}: {rows}", flush=True)
            fast.close()
            raw.close()
            del raw, fast
            torch.cuda.empty_cache()


def vocab_size(model_dir: Path) -> int:
    """The model's vocabulary (a multimodal config keeps it in ``text_config``)."""
    import json

    config = json.loads((model_dir / "config.json").read_text())
    return int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size") or 32000)


def margin(raw: Raw, ids: list[int], a: int, b: int) -> float | str:
    """The raw model's logit of token ``a`` minus that of ``b`` after ``ids`` (a lone forward, no cache)."""
    import torch

    try:
        with torch.inference_mode():
            logits = raw.model.forward(torch.tensor([ids]), {"attn_mode": "flash_attn_nc"})
    except Exception as e:  # noqa: BLE001 - recorded, not hidden
        return f"not measured: {type(e).__name__}: {str(e)[:200]}"
    row = logits[0, -1].float()
    return float(row[a] - row[b])


SAMPLED = {
    "temperature 0.8": {"temperature": 0.8},
    "temperature 1.0, top_k 40": {"temperature": 1.0, "top_k": 40},
    "temperature 0.7, top_p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "temperature 1.0, min_p 0.05": {"temperature": 1.0, "min_p": 0.05},
    "temperature 0.9, min_p 0.02, top_k 50, top_p 0.95": {
        "temperature": 0.9,
        "min_p": 0.02,
        "top_k": 50,
        "top_p": 0.95,
    },
    "temperature 1.0, repetition 1.3, logit bias": {
        "temperature": 1.0,
        "rep_p": 1.3,
        "logit_bias": {5: 4.0, 7: -100.0},
    },
}


def section_sampled(args: Any, models: dict[str, Path]) -> None:
    """The batched sampler's draws against exllamav3's ComboSampler's on the same logits (one row, many seeds)."""
    import torch
    from exllamav3 import ComboSampler

    from exllama_integrations.backends.exllamav3.fast.sampler import BatchedSampler, RowSettings

    torch.manual_seed(5)
    vocab = 32000
    base = torch.randn(1, vocab, device="cuda") * 3.0
    past = torch.randint(0, vocab, (1, 64), device="cuda")
    for name, s in SAMPLED.items():
        combo = ComboSampler(
            rep_p=s.get("rep_p", 1.0),
            temperature=s["temperature"],
            min_p=s.get("min_p", 0.0),
            top_k=s.get("top_k", 0),
            top_p=s.get("top_p", 1.0),
            logit_bias=s.get("logit_bias"),
        )
        ref = [int(combo.forward(base.clone().view(1, 1, vocab), past, seed).item()) for seed in range(args.draws)]
        row = RowSettings(
            temperature=s["temperature"],
            top_k=s.get("top_k", 0),
            top_p=s.get("top_p", 1.0),
            min_p=s.get("min_p", 0.0),
            repetition_penalty=s.get("rep_p", 1.0),
            logit_bias=tuple(sorted(s.get("logit_bias", {}).items())),
            seed=99,
        )
        sampler = BatchedSampler(vocab)
        ours: list[int] = []
        chunk = 500
        for start in range(0, args.draws, chunk):
            n = min(chunk, args.draws - start)
            t = sampler.sample(
                base.expand(n, vocab),
                [row] * n,
                list(range(start, start + n)),
                [past[0]] * n,
                [0] * n,
            )
            ours += t.tolist()
        stat, dof, p = chi_square(ref, ours)
        result = {"draws": args.draws, "chi2": stat, "dof": dof, "p_value": p, "distinct_ref": len(set(ref))}
        note(args.out, f"sampled {name}", result)
        print(f"[sampled] {name}: {result}", flush=True)


def chi_square(a: list[int], b: list[int]) -> tuple[float, int, float]:
    """Two-sample chi-square over tokens drawn >= 5 times in all (the rest pooled); statistic, dof, p-value."""
    from collections import Counter

    from scipy.stats import chi2_contingency

    ca, cb = Counter(a), Counter(b)
    keys = [k for k in set(ca) | set(cb) if ca[k] + cb[k] >= 5]
    rest_a = len(a) - sum(ca[k] for k in keys)
    rest_b = len(b) - sum(cb[k] for k in keys)
    table = [[ca[k] for k in keys], [cb[k] for k in keys]]
    if rest_a + rest_b:
        table[0].append(rest_a)
        table[1].append(rest_b)
    if len(table[0]) < 2:
        return 0.0, 0, 1.0
    stat, p, dof, _ = chi2_contingency(table)
    return float(stat), int(dof), float(p)


def first_step(raw: Raw, prompts: Prompts, jobs: int, force: dict[str, Any], per_call: bool) -> dict[str, float]:
    """``jobs`` prompts enqueued together: the first ``iterate()`` (their prefill and the first decode step), wall
    with a synchronize; ``force``: params added to every ``Model.prefill`` call; ``per_call``: a synchronize after
    each call, its wall counted (with batched prefill a call only holds its chunk)."""
    import torch

    had = vars(raw.model).get("prefill")  # the fast path's hook, if any: wrapped, then put back
    prefill = raw.model.prefill
    calls: list[float] = []

    def wrapped(*a: Any, **k: Any) -> Any:
        k.get("params", {}).update(force)
        t = time.perf_counter()
        try:
            return prefill(*a, **k)
        finally:
            if per_call:
                torch.cuda.synchronize()
            calls.append(time.perf_counter() - t)

    raw.model.prefill = wrapped
    listed = raw.enqueue(prompts.take(jobs), 4)
    try:
        with torch.inference_mode():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            raw.generator.iterate()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
    finally:
        if had is None:
            del raw.model.prefill
        else:
            raw.model.prefill = had
        for j in listed:
            raw.generator.cancel(j)
    return {"first_step_ms": 1000 * wall, "prefill_calls": len(calls), "call_ms": 1000 * statistics.median(calls)}


def kernel_table(prof: Any, wall_ms: float) -> dict[str, Any]:
    """torch.profiler's kernels: GPU-busy time and share of ``wall_ms``, the 12 longest by name."""
    import torch

    by_name: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name.setdefault(e.name, []).append(e.device_time_total / 1000)
    total = sum(sum(v) for v in by_name.values())
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]
    return {
        "first_step_ms_under_profiler": wall_ms,
        "gpu_busy_ms": total,
        "gpu_busy_share": total / wall_ms,
        "kernels": [{"name": k[:90], "count": len(v), "ms": round(sum(v), 2)} for k, v in top],
    }


def section_prefill(args: Any, models: dict[str, Path]) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    for name, path in models.items():
        raw = Raw(path, fast=False)
        fast = Raw(path, fast=True, prefill=True)  # batched prefill, on a model of its own
        prompts = Prompts(32000)
        variants = {
            "exllamav3's choice": (raw, {}),
            "reconstruct forced": (raw, {"reconstruct": True}),
            'decode="fast", batched prefill': (fast, {}),
        }

        def step(r: Raw, force: dict[str, Any], p: Prompts = prompts) -> Callable[[], dict[str, float]]:
            return lambda: first_step(r, p, 64, force, per_call=False)

        paths = {f"64 jobs, {label}": step(r, force) for label, (r, force) in variants.items()}
        _interleave(RESULTS, args.out, f"prefill {name}", paths, args.reps)  # a warm-up round first, then rotated
        ratios(
            args.out,
            f"prefill {name}",
            [('64 jobs, decode="fast", batched prefill', "64 jobs, exllamav3's choice")],
            more=("first_step_ms",),
        )
        for label, (r, force) in variants.items():
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                row = first_step(r, prompts, 64, force, per_call=False)
            note(args.out, f"prefill {name} profile, {label}", kernel_table(prof, row["first_step_ms"]))
        # the tokens: batched prefill against exllamav3's own loop, prompts of one length and of many
        for batch, ragged in ((16, False), (64, False), (64, True)):
            row = compare(raw, fast, prompts.take(batch, ragged=ragged), args.new)
            note(args.out, f"prefill {name} greedy, {batch} jobs{', ragged prompts' if ragged else ''}", row)
            print(f"[prefill greedy] {name} {batch} ragged={ragged}: {row}", flush=True)
        note(args.out, f"prefill {name} fast path report", fast.fast.report())  # type: ignore[union-attr]
        for r in (raw, fast):
            r.close()
        del raw, fast, r
        torch.cuda.empty_cache()


def section_bench(args: Any, models: dict[str, Path]) -> None:
    import torch

    for name, path in models.items():
        raw = Raw(path, fast=False)
        fast = Raw(path, fast=True)  # a model of its own: no state shared with the raw one
        sampler_only = Raw(path, fast=True, graphs=False) if args.sampler_alone else None
        not_ahead = Raw(path, fast=True, ahead=False) if args.ahead_row else None
        apart = Raw(path, fast=True, deterministic=True, strategy="rows apart") if args.deterministic_row else None
        pinned = Raw(path, fast=True, deterministic=True, strategy="pinned") if args.pinned_row else None
        prompts = Prompts(vocab_size(path))
        for batch in args.batches:

            def row(r: Raw, b: int = batch, p: Prompts = prompts) -> Callable[[], dict[str, float]]:
                def go() -> dict[str, float]:
                    out = r.run(p.take(b), args.new)
                    return {"tok_s": out["tok_s"], "step_ms": out["step_ms"]}

                return go

            section = f"bench {name} batch {batch}"
            paths = {
                f"raw exllamav3: {batch} Jobs together": row(raw),
                f'decode="fast": {batch} Jobs together': row(fast),
            }
            if sampler_only is not None:
                paths[f"batched sampler alone: {batch} Jobs together"] = row(sampler_only)
            if not_ahead is not None:
                paths[f'decode="fast" without running ahead: {batch} Jobs together'] = row(not_ahead)
            if apart is not None:
                paths[f'decode="fast", deterministic=True: {batch} Jobs together'] = row(apart)
            if pinned is not None:
                paths[f'decode="fast", deterministic=True, pinned: {batch} Jobs together'] = row(pinned)
            _interleave(RESULTS, args.out, section, paths, args.reps)
            names = list(paths)
            pairs = [(n, names[0]) for n in names[1:]]
            if not_ahead is not None:  # what running ahead adds, in the same run
                pairs.append((names[1], f'decode="fast" without running ahead: {batch} Jobs together'))
            for other in (f"deterministic=True: {batch}", f"deterministic=True, pinned: {batch}"):
                if f'decode="fast", {other} Jobs together' in paths:  # what each strategy costs, in the same run
                    pairs.append((f'decode="fast", {other} Jobs together', names[1]))
            ratios(args.out, section, pairs, more=("step_ms",))
        if args.first_prompt:  # (one page a forward: the chunking before fast/chunk_plan.py, for the same run)
            one_page = Raw(path, fast=True, deterministic=True, det_chunk=256) if args.one_page_row else None
            first_tokens(args, name, prompts, {"raw exllamav3": raw, 'decode="fast"': fast, "deterministic=True": apart,
                                               "deterministic=True, pinned": pinned,
                                               "deterministic=True, one page a forward": one_page})  # fmt: skip
            if one_page is not None:
                one_page.close()
        note(args.out, f"bench {name} fast path report", fast.fast.report())  # type: ignore[union-attr]
        if pinned is not None:
            note(args.out, f"bench {name} pinned fast path report", pinned.fast.report())  # type: ignore[union-attr]
        fast.close()
        for other in (sampler_only, not_ahead, apart, pinned):
            if other is not None:
                other.close()
        raw.close()
        del raw, fast, sampler_only, not_ahead, apart, pinned
        torch.cuda.empty_cache()


def first_tokens(args: Any, name: str, prompts: Prompts, modes: dict[str, Raw | None]) -> None:
    """Each mode's time to the first token of a cold prompt of ``--first-prompt`` tokens alone, interleaved."""
    tokens = Prompts(prompts.vocab, args.first_prompt)
    paths = {f"first token, {mode}": (lambda r=r: r.first_token(tokens.take(1)[0])) for mode, r in modes.items() if r}
    section = f"bench {name} first token, {args.first_prompt}-token prompt"
    _interleave(RESULTS, args.out, section, paths, args.reps)
    base = 'first token, decode="fast"'
    pairs = [(k, base) for k in paths if k != base and "deterministic" in k]
    ratios(args.out, section, pairs, key="first_token_ms")


def device_copy_bandwidth(gib: int = 4, reps: int = 10) -> float:
    """GB/s of a device-to-device copy (read + write counted): the bandwidth a weight-reading step can reach."""
    import torch

    a = torch.empty(gib << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        b.copy_(a)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - t) / reps
    del a, b
    torch.cuda.empty_cache()
    return round(2 * (gib << 30) / seconds / 1e9, 1)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--sections", default="profile,greedy,sampled,bench")
    ap.add_argument("--models", default="exl3,fp16")
    ap.add_argument("--draws", type=int, default=4000)
    ap.add_argument("--families", default="", help="families: only these (comma-separated names of ARCHS)")
    ap.add_argument(
        "--fixtures",
        type=Path,
        default=None,
        help="families: also the carried 2026 families (the folder tests/gpu/build_family_fixtures.py wrote)",
    )
    ap.add_argument(
        "--no-sampler-alone", dest="sampler_alone", action="store_false", help="bench: leave out the sampler-alone row"
    )
    ap.add_argument(
        "--no-ahead-row", dest="ahead_row", action="store_false", help="bench: leave out the row without running ahead"
    )
    ap.add_argument(
        "--no-deterministic-row",
        dest="deterministic_row",
        action="store_false",
        help="bench: leave out the deterministic=True row",
    )
    ap.add_argument(
        "--pinned-row",
        dest="pinned_row",
        action="store_true",
        help="bench: add deterministic=True's pinned strategy (fast/pinned.py), beside the rows-apart one",
    )
    ap.add_argument(
        "--first-prompt",
        type=int,
        default=0,
        help="bench: also each row's time to the first token of a cold prompt of this many tokens (0: not measured)",
    )
    ap.add_argument(
        "--one-page-row",
        dest="one_page_row",
        action="store_true",
        help="bench, with --first-prompt: add deterministic=True prefilling one page a forward (the former chunking)",
    )
    ap.add_argument("--batches", type=lambda v: [int(b) for b in v.split(",")], default=[1, 16, 64])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    note(args.out, "gpu", torch.cuda.get_device_name(0))
    from importlib.metadata import version

    note(args.out, "exllamav3", version("exllamav3"))
    models = load_models(args)
    note(args.out, "device_copy_GBps", device_copy_bandwidth())
    for name, path in models.items():  # the bytes a decode step reads at least: every weight once
        note(args.out, f"{name} weight bytes", sum(p.stat().st_size for p in path.glob("*.safetensors")))
    sections = args.sections.split(",")
    for s in sections:
        t0 = time.perf_counter()
        sections_by_name = {
            "profile": section_profile,
            "greedy": section_greedy,
            "families": section_families,
            "sampled": section_sampled,
            "bench": section_bench,
            "prefill": section_prefill,
        }
        sections_by_name[s](args, models)
        note(args.out, f"seconds of the {s} section", round(time.perf_counter() - t0, 1))


if __name__ == "__main__":
    main()
