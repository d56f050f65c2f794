"""The GPU invariance probe (benchmarks/gpu_invariance_probe.py, issue 57) before it spends device time.

Its dry run runs here without CUDA: the arguments, the plan of every section and the arithmetic of each pin (which
exllamav3's launch formulas must reproduce), and, with ``EXLLAMAV3_SOURCE`` set to an unpacked exllamav3 1.6.5 wheel,
every exllamav3 member and extension function it reaches. Its summary (the table the lead reads) is checked on lines
shaped as the GPU writes them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_invariance_probe.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

import _probe_core as core  # noqa: E402


def _dry_run(tmp_path: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), *extra],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def test_the_dry_run_plans_every_section_on_a_cpu(tmp_path: Path) -> None:
    proc = _dry_run(tmp_path, env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [json.loads(x) for x in (tmp_path / "gpu_invariance_probe.jsonl").read_text().splitlines()]
    plans = [x for x in lines if x["kind"] == "plan"]
    assert {x["section"] for x in plans} == {"attention", "exl3_gemm", "fp16_gemm", "norms", "step"}
    assert all(x["rows"] == [1, 2, 3, 4, 8, 9, 16, 17, 32, 64] for x in plans)
    pinned = [x for x in plans if x["section"] == "attention" and x["pin"].startswith("split_len=")]
    assert len(pinned) == 2 * 2 * 3  # two head shapes, widths 16 and 32, three split lengths
    assert all(x["split_len"] == int(x["pin"].split("=")[1]) for x in pinned)
    exl3 = [x for x in plans if x["section"] == "exl3_gemm" and "forced_shapes" in x]
    assert all(x["forced_shapes"][:2] == [1, 2] for x in exl3)  # the pins pad16+shape=1/2 exist for every GEMM


def test_the_dry_run_refuses_a_section_it_does_not_have(tmp_path: Path) -> None:
    proc = _dry_run(tmp_path, "--sections", "attention,warp")
    assert proc.returncode == 2
    assert "unknown sections ['warp']" in proc.stderr
    proc = _dry_run(tmp_path, "--section-s", "step=lots")
    assert proc.returncode == 2 and "--section-s takes SECTION=SECONDS" in proc.stderr


def test_exllamav3s_split_rule_as_the_probe_reads_it() -> None:
    """One row of a 1B model (8 kv heads, 132 SMs) splits its keys every 128 at a 16-page table, a batch of 16 every
    2112: why a row's attention sums differently in a batch, and what a pinned split length removes."""
    alone = core.default_splits(1, kv_heads=8, group=2, sms=132, width=16, block_n=64)
    assert (alone, core.split_len(16, alone, 64)) == (33, 128)
    batched = core.default_splits(16, kv_heads=8, group=2, sms=132, width=16, block_n=64)
    assert (batched, core.split_len(16, batched, 64)) == (2, 2112)
    assert core.default_splits(64, 8, 2, 132, 16, 64) == 1
    for width in (16, 32, 48):
        for length in (128, 256, 512):
            splits, max_kv = core.fixed_split_plan(width, length)
            assert core.split_len(width, splits, 64, max_kv) == length
    with pytest.raises(ValueError, match="does not divide"):
        core.fixed_split_plan(17, 512)


def test_the_forced_exl3_shape_and_the_row_padding() -> None:
    assert core.exl3_pinned_shape(2048, 128256) == 2 and core.exl3_shape_fits(3, 2048, 128256)
    assert not core.exl3_shape_fits(4, 2048, 128256)  # 128256 is no multiple of 512
    assert core.exl3_pinned_shape(2048, 1024, prefer=(4, 1)) == 4
    with pytest.raises(ValueError):
        core.exl3_pinned_shape(2048, 1000)
    assert [core.padded(r, 16) for r in (1, 16, 17, 64)] == [16, 16, 32, 64]
    assert {core.padded(r, 64) for r in (1, 9, 64)} == {64}
    assert core.fixed_split_k(2048, 8192) == 4 and core.fixed_split_k(128256, 2048) == 1


def test_the_summary_counts_equal_rows_and_prices_the_pinned_step(tmp_path: Path) -> None:
    import gpu_invariance_probe as probe

    rec = core.Recorder(tmp_path)
    for rows, equal in ((2, True), (16, False), (64, True)):
        rec.write(kind="invariance", section="exl3_gemm", op="q", pin="none", rows=rows, bitwise_equal=equal,
                  max_abs_diff=0.0 if equal else 0.25)  # fmt: skip
    rec.write(kind="cost", section="exl3_gemm", op="q", pin="pad16+shape=2", rows=16, median_us=12.0,
              cost_vs_unpinned=1.2)  # fmt: skip
    for pin, tok in (("none", (400.0, 2800.0, 4200.0)), ("pinned", (380.0, 2240.0, 2940.0))):
        for rows, t in zip((1, 16, 64), tok, strict=True):
            rec.write(kind="cost", section="step", op="EXL3 step", pin=pin, rows=rows, median_us=1.0, tok_s=t)
    rec.write(kind="cost", section="step", op="EXL3 step", pin="pinned", rows=16, env="X=1", tok_s=1.0)
    out = probe.summary(tmp_path, rec.path)
    rows = {(r["section"], r["pin"], r["env"]): r for r in out["table"]}
    assert (rows["exl3_gemm", "none", ""]["equal"], rows["exl3_gemm", "none", ""]["of"]) == (2, 3)
    assert rows["exl3_gemm", "none", ""]["worst_abs_diff"] == 0.25
    assert rows["exl3_gemm", "pad16+shape=2", ""]["ratio"] == {16: 1.2}
    price = rows["step", "pinned", ""]["tok_s_vs_unpinned"]
    assert price == pytest.approx({1: 0.95, 16: 0.8, 64: 0.7})
    assert {(h["section"], h["pin"]): (h["held"], h["ops"]) for h in out["held"]} == {("exl3_gemm", "none"): (0, 1)}
    assert (tmp_path / "gpu_invariance_probe_summary.json").is_file()


def test_held_picks_the_cheapest_pin_kept_everywhere() -> None:
    import gpu_invariance_probe as probe

    rows = [
        {"kind": "invariance", "section": "attention", "op": op, "pin": pin, "rows": 16, "bitwise_equal": eq}
        for op in ("a", "b")
        for pin, eq in (("none", False), ("split_len=128", True), ("split_len=256", True), ("splits=1", op == "a"))
    ]
    rows += [{"kind": "cost", "section": "attention", "op": "a", "pin": p, "rows": 16, "cost_vs_unpinned": c}
             for p, c in (("split_len=128", 1.3), ("split_len=256", 1.1), ("splits=1", 0.9))]  # fmt: skip
    cands = [("none", None), ("split_len=128", "L128"), ("split_len=256", "L256"), ("splits=1", "S1")]
    assert probe.held(rows, "attention", cands, "default")[0] == "L256"  # splits=1 is cheaper but broke op b
    assert probe.held(rows, "attention", [("none", None)], "default")[0] == "default"
    assert probe.held([{**r, "env": "X=1"} for r in rows], "attention", cands, "default")[0] == "default"


@pytest.mark.skipif(
    not os.environ.get("EXLLAMAV3_SOURCE"), reason="set EXLLAMAV3_SOURCE to an unpacked exllamav3 1.6.5 wheel"
)
def test_everything_the_probe_reaches_in_exllamav3_is_there(tmp_path: Path) -> None:
    source = Path(os.environ["EXLLAMAV3_SOURCE"]) / "exllamav3"
    assert core.unmet(source) == []
    proc = _dry_run(tmp_path)
    assert proc.returncode == 0, proc.stdout
    lines = [json.loads(x) for x in (tmp_path / "gpu_invariance_probe.jsonl").read_text().splitlines()]
    assert [x["unmet"] for x in lines if x["kind"] == "requirements"] == [[]]
    assert core.unmet(tmp_path) == [f"{r.key}: missing" for r in core.requirements()]  # (a folder without it)


def test_each_pin_is_compared_at_every_row_count_then_timed_against_unpinned(tmp_path: Path, monkeypatch) -> None:
    """The op runner on a CPU: a kernel whose row depends on the batch (a mean over rows leaks in) reads unequal from
    2 rows on, its pinned twin equal everywhere; both are timed after every comparison, the pin against unpinned."""
    import _probe_ops as ops
    import torch

    monkeypatch.setattr(ops, "timed", lambda torch, fn: {"median_us": 10.0 if fn().shape[0] < 64 else 20.0})
    rec = core.Recorder(tmp_path)
    budget = core.Budget(60)
    budget.start("x", 60)
    ctx = ops.Ctx(torch, rec, budget, time_rows=(1, 64))
    row = torch.randn(1, 8)

    def make(pinned: bool):
        def rows(n: int):
            x = ops.batch(ctx, row, n, 3)
            return lambda: x * 2 if pinned else x * 2 + 1e-3 * x.mean(0)

        return rows

    ops.run_op(ctx, "s", "op", {"k": 8}, {"none": make(False), "pinned": make(True)}, lambda o, t: o[t])
    assert {r["kind"] for r in rec.rows} == {"invariance"}  # (the costs wait until every op was compared)
    ops.time_pins(ctx)
    inv = [r for r in rec.rows if r["kind"] == "invariance"]
    assert [r["rows"] for r in inv] == [1, *core.ROWS] * 2
    assert not any(r["bitwise_equal"] for r in inv if r["pin"] == "none" and r["rows"] > 1)
    assert all(r["bitwise_equal"] for r in inv if r["pin"] == "pinned" and r["rows"] > 1)
    assert [r.get("same_as_unpinned_alone") for r in inv if r["rows"] == 1] == [None, False]
    cost = [r for r in rec.rows if r["kind"] == "cost"]
    assert [(r["pin"], r["rows"], r.get("cost_vs_unpinned")) for r in cost] == [
        ("none", 1, None), ("none", 64, None), ("pinned", 1, 1.0), ("pinned", 64, 1.0)
    ]  # fmt: skip
    assert len((tmp_path / "gpu_invariance_probe.jsonl").read_text().splitlines()) == len(rec.rows)


def _fake_exllamav3(monkeypatch) -> dict[str, object]:
    """The four exllamav3 modules the step's pins patch, as fakes that record how they are called."""
    import types

    import torch

    calls: dict[str, list] = {"decode": [], "gemm": [], "mgemm": []}
    mods = {n: types.ModuleType(n) for n in ("exllamav3", "exllamav3.ext", "exllamav3.modules",
            "exllamav3.modules.attention_fn", "exllamav3.modules.attention_fn.triton_paged", "exllamav3.modules.quant",
            "exllamav3.modules.quant.exl3", "exllamav3.modules.quant.fp16")}  # fmt: skip
    ext = types.ModuleType("exllamav3_ext")

    def exl3_gemm(a, b, c, suh, a_had, svh, shape, mcg, mul1, sms):
        calls["gemm"].append((tuple(a.shape), shape))
        c.copy_(a.float() @ b)

    ext.exl3_gemm = exl3_gemm
    ext.exl3_mgemm = lambda *a, **kw: calls["mgemm"].append(a[9])
    mods["exllamav3.ext"].exllamav3_ext = ext
    tp = mods["exllamav3.modules.attention_fn.triton_paged"]
    tp.paged_attn_triton_decode = lambda **kw: calls["decode"].append(kw)
    mods["exllamav3.modules.attention_fn"].triton_paged = tp

    class LinearEXL3:
        out_features, default_out_dtype, bias, mcg, mul1 = 128, torch.float32, None, False, True

        def __init__(self) -> None:
            self.trellis, self.suh, self.svh = torch.randn(64, 128), None, None

        def forward(self, x, params, out_dtype=None):
            return "exllamav3's own"

    class LinearFP16:
        def __init__(self) -> None:
            self.weight = torch.randn(64, 32)

        def forward(self, x, params, out_dtype=None):
            calls.setdefault("fp16 rows", []).append(x.shape[0])
            return x @ self.weight

    mods["exllamav3.modules.quant.exl3"].LinearEXL3 = LinearEXL3
    mods["exllamav3.modules.quant.exl3"].AUTO_RECONSTRUCT_THRESHOLD = 144
    mods["exllamav3.modules.quant.fp16"].LinearFP16 = LinearFP16
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return {"calls": calls, "tp": tp, "ext": ext, "LinearEXL3": LinearEXL3, "LinearFP16": LinearFP16}


def test_the_step_pins_patch_exllamav3_as_measured_and_restore_it(tmp_path: Path, monkeypatch) -> None:
    """What each pin does to exllamav3's calls in the whole step, and that leaving the pins restores every one."""
    import types

    import _probe_ops as ops
    import _probe_step as step
    import torch

    fake = _fake_exllamav3(monkeypatch)
    calls, tp, ext, LinearEXL3, LinearFP16 = (fake[k] for k in ("calls", "tp", "ext", "LinearEXL3", "LinearFP16"))
    own = (tp.paged_attn_triton_decode, ext.exl3_mgemm, LinearEXL3.forward, LinearFP16.forward)
    attn = types.SimpleNamespace(multi_qkv="qkv", multi_kv="kv", multi_qg=None, modules=[])
    mlp = types.SimpleNamespace(multi_gu=["gu"], modules=[])
    model = types.SimpleNamespace(modules=[types.SimpleNamespace(modules=[attn, mlp])])
    ctx = ops.Ctx(torch, core.Recorder(tmp_path), core.Budget(60))
    pins = {"attention": "split_len=256", "exl3": "unfused", "fp16": "pad64"}
    with step.patched(ctx, model, pins) as counts:
        tp.paged_attn_triton_decode(k=torch.zeros(3, 1, 8, 128), block_table=torch.zeros(3, 32), num_splits=None)
        assert (attn.multi_qkv, attn.multi_kv, mlp.multi_gu) == (None, None, [None])
        x = torch.randn(3, 1, 64)
        y = LinearEXL3().forward(x, {})
        assert y.shape == (3, 1, 128) and calls["gemm"] == [((16, 64), 2)]  # 16 rows, a forced shape
        w = LinearFP16()
        assert torch.allclose(LinearFP16.forward(w, x, {}), x @ w.weight, atol=1e-4) and calls["fp16 rows"] == [64]
        assert LinearEXL3().forward(torch.randn(200, 64), {}) == "exllamav3's own"  # past 144 rows: reconstruct
    assert calls["decode"][0]["num_splits"] == 32 and calls["decode"][0]["max_kv_len"] == 32 * 256 - 1
    assert counts == {"attention pinned": 1, "attention passed": 0, "exl3 pinned": 1, "mgemm pinned": 0,
                      "fp16 pinned": 1}  # fmt: skip
    assert (tp.paged_attn_triton_decode, ext.exl3_mgemm, LinearEXL3.forward, LinearFP16.forward) == own
    assert (attn.multi_qkv, attn.multi_kv, mlp.multi_gu) == ("qkv", "kv", ["gu"])
    with step.patched(ctx, model, {"attention": "splits=1", "exl3": "mgemm_forced"}):
        ext.exl3_mgemm(torch.zeros(1, 3, 64), None, torch.zeros(2, 3, 128), None, None, None, None, None, 4, -1)
        ext.exl3_mgemm(torch.zeros(1, 3, 64), None, torch.zeros(2, 3, 128), None, None, None, None, None, 4, 3)
        tp.paged_attn_triton_decode(k=torch.zeros(1, 1, 8, 128), block_table=torch.zeros(1, 16))
        assert attn.multi_qkv == "qkv"
    assert calls["mgemm"] == [2, 3] and calls["decode"][1]["num_splits"] == 1
    assert ext.exl3_mgemm is own[1]
