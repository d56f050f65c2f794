"""``deterministic=True``'s pinned strategy on the CPU: the pins' arithmetic, the patches applied and removed as one
unit, what each pinned call hands exllamav3's kernels, and where the strategy stands aside (rows apart, with why).

That a row's logits are then the same alone, in 16 and in 64 is for the GPU (tests/gpu/test_gpu_pinned.py): here the
kernels are fakes that record what they were handed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from exllama_integrations.backends.exllamav3 import upstream  # noqa: E402
from exllama_integrations.backends.exllamav3.fast import decode as fast_decode  # noqa: E402
from exllama_integrations.backends.exllamav3.fast import deterministic as det  # noqa: E402
from exllama_integrations.backends.exllamav3.fast.pinned import (  # noqa: E402
    EXL3_TILES,
    SPLIT_LEN,
    bucket,
    exl3_shapes,
    split_plan,
)
from exllama_integrations.backends.exllamav3.fast.requirements import PAGE_SIZE  # noqa: E402
from exllama_integrations.backends.exllamav3.fast.seam import pins as seam_pins  # noqa: E402

# ---------------------------------------------------------------------- the arithmetic


def kernel_splits(width: int, rows: int, block_n: int, num_splits: int | None, max_kv_len: int | None) -> list[int]:
    """Where each split of a row starts: ``paged_attn_triton_decode``'s own arithmetic (exllamav3 1.6.5,
    triton_paged.py:1276-1291), for a step of ``rows`` rows, 8 kv heads and 132 SMs."""
    appended, programs = 1, rows * 8
    max_k_len = width * PAGE_SIZE + appended
    if max_kv_len is not None:
        max_k_len = min(max_k_len, max_kv_len + appended)
    splits = num_splits or max(1, min(2 * 132 // programs, -(-max_k_len // block_n), 128))
    per_split = -(-max_k_len // splits)
    length = -(-per_split // block_n) * block_n
    return [s * length for s in range(splits)]


def row_splits(starts: list[int], tokens: int) -> list[tuple[int, int]]:
    """The splits that hold keys of a row of ``tokens`` keys: (start, end)."""
    ends = [*starts[1:], 1 << 30]
    return [(a, min(b, tokens)) for a, b in zip(starts, ends, strict=True) if a < tokens]


def test_a_rows_attention_splits_follow_the_batch_unpinned_and_are_the_same_pinned() -> None:
    tokens = 1000  # one row's keys; the others decide the step's rows and its table's width
    alone = row_splits(kernel_splits(16, 1, 64, None, None), tokens)
    assert alone != row_splits(kernel_splits(16, 16, 64, None, None), tokens)  # exllamav3's choice: by the batch
    for block_n in (32, 64, 128, 256):
        pinned = set()
        for rows, width in ((1, 16), (16, 16), (64, 16), (2, 32), (64, 48)):
            splits, max_kv = split_plan(width, PAGE_SIZE)
            assert splits >= 2  # never the kernel's one-split path (it stores without the combine pass)
            pinned.add(tuple(row_splits(kernel_splits(width, rows, block_n, splits, max_kv), tokens)))
        assert pinned == {((0, 256), (256, 512), (512, 768), (768, 1000))}, block_n


def test_the_split_plan_refuses_what_it_cannot_pin() -> None:
    assert split_plan(16, 256) == (16, 16 * 256 - 1)
    assert split_plan(16, 256, 512, appended=3) == (8, 8 * 512 - 3)  # a quantized cache's pre-appended keys
    with pytest.raises(ValueError, match="does not divide"):
        split_plan(3, 256, 512)
    with pytest.raises(ValueError, match="one split"):
        split_plan(1, 256)


def test_the_gemm_bucket_is_the_largest_batch_in_16_row_steps_and_the_exl3_shapes_divide_the_matrix() -> None:
    assert [bucket(n) for n in (1, 16, 17, 64)] == [16, 16, 32, 64]
    with pytest.raises(ValueError):
        bucket(0)
    assert exl3_shapes(2048, 2048) == (7, 2, 1)
    assert exl3_shapes(2064, 2048) == (1,)  # k = 129 x 16: only the 16-deep tile divides it
    assert all(EXL3_TILES[s][0] in (16, 64) for s in exl3_shapes(2048, 5632))


# ---------------------------------------------------------------------- the patches, on fake exllamav3 objects


class FakeEXL3:
    """``LinearEXL3`` in miniature: its own forward is a plain product; ``weights`` lets the fake kernel find it."""

    weights: dict[int, Any] = {}

    def __init__(self, k: int, n: int) -> None:
        self.trellis = torch.zeros((k // 16, n // 16, 64), dtype=torch.int16)
        self.suh, self.svh = torch.ones(k), torch.ones(n)
        self.mcg, self.mul1, self.bias = False, True, torch.full((n,), 0.5)
        self.out_features, self.default_out_dtype = n, torch.float32
        self.w = torch.randn(k, n, generator=torch.Generator().manual_seed(k + n))
        FakeEXL3.weights[id(self.trellis)] = self.w

    def forward(self, x: Any, params: dict[str, Any], out_dtype: Any = None) -> Any:
        return x @ self.w + self.bias


class FakeFP16:
    seen: list[int] = []

    def __init__(self, k: int, n: int) -> None:
        self.w = torch.randn(k, n, generator=torch.Generator().manual_seed(7))

    def forward(self, x: Any, params: dict[str, Any], out_dtype: Any = None) -> Any:
        FakeFP16.seen.append(x.numel() // x.shape[-1])
        return (x.reshape(-1, x.shape[-1]) @ self.w).view(*x.shape[:-1], self.w.shape[1])


class FakeExt:
    """The extension's ``exl3_gemm``: refuses ``refuse`` (as its shared-memory check does), records what it ran."""

    def __init__(self, refuse: int = 7) -> None:
        self.refuse, self.ran, self.tried = refuse, [], []
        self.without: set[int] = set()  # shapes it has no kernel of: it returns 0 and writes nothing

    def exl3_gemm(self, a: Any, trellis: Any, c: Any, suh: Any, a_had: Any, svh: Any, shape: int, *rest: Any) -> int:
        self.tried.append(shape)
        if shape == self.refuse:
            raise RuntimeError(f"exl3_gemm: shape {shape} needs more shared memory")
        if shape in self.without:
            return 0
        assert rest == (False, True, 0)  # mcg, mul1, force_num_sms: the linear's own, all SMs
        self.ran.append((a.shape[0], shape))
        c.copy_(a @ FakeEXL3.weights[id(trellis)])
        return shape


class Attention:
    def __init__(self) -> None:
        self.multi_qkv, self.multi_kv, self.multi_qg, self.sliding_window = "qkv", None, "qg", -1


class GatedMLP:
    def __init__(self) -> None:
        self.multi_gu = ["gu"]


class Linear:
    def __init__(self, quant_type: str = "exl3") -> None:
        self.quant_type, self.lora_a_tensors = quant_type, {}


class FakeView:
    def __init__(self, modules: list[Any]) -> None:
        self.model = SimpleNamespace(modules=modules)
        self.why_not: str | None = None
        self.recurrent: list[str] = []
        self.own_off = 0

    @contextmanager
    def own_graphs_off(self) -> Iterator[None]:
        self.own_off += 1
        try:
            yield
        finally:
            self.own_off -= 1


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    def decode(**kw: Any) -> Any:
        return kw

    tp = SimpleNamespace(paged_attn_triton_decode=decode)
    ext = FakeExt()
    modules = {
        "exllamav3.modules.attention_fn.triton_paged": tp,
        "exllamav3.modules.quant.exl3": SimpleNamespace(ext=ext),
    }
    for name, value in {"LinearEXL3": FakeEXL3, "LinearFP16": FakeFP16, "Attention": Attention, "GatedMLP": GatedMLP,
                        "Linear": Linear, "module": modules.__getitem__}.items():  # fmt: skip
        monkeypatch.setitem(vars(upstream), name, value)  # (the boundary resolves a name it lacks on first use)
    monkeypatch.setattr(seam_pins, "pinned_unmet", lambda: [])
    attn, mlp = Attention(), GatedMLP()
    view = FakeView([SimpleNamespace(modules=[attn, mlp, Linear()])])
    return SimpleNamespace(tp=tp, ext=ext, attn=attn, mlp=mlp, view=view, decode=decode)


def test_every_pin_is_applied_for_the_forward_and_removed_after_it_even_when_it_fails(fakes: SimpleNamespace) -> None:
    own = (FakeEXL3.forward, FakeFP16.forward, fakes.decode)
    pins = seam_pins.LaunchPins(fakes.view, bucket=16)  # type: ignore[arg-type]
    with pins.applied():
        assert FakeEXL3.forward is not own[0] and FakeFP16.forward is not own[1]
        assert fakes.tp.paged_attn_triton_decode is not own[2]
        assert (fakes.attn.multi_qkv, fakes.attn.multi_qg, fakes.mlp.multi_gu) == (None, None, [None])
        assert fakes.view.own_off == 1  # exllamav3's own per-layer graphs stand aside too
        inner = FakeEXL3.forward
        with pins.applied():  # reentrant: not wrapped twice
            assert FakeEXL3.forward is inner
    assert (FakeEXL3.forward, FakeFP16.forward, fakes.tp.paged_attn_triton_decode) == own
    assert (fakes.attn.multi_qkv, fakes.attn.multi_kv, fakes.mlp.multi_gu) == ("qkv", None, ["gu"])
    with pytest.raises(KeyError), pins.applied():
        raise KeyError("a forward that fails")
    assert (FakeEXL3.forward, FakeFP16.forward, fakes.tp.paged_attn_triton_decode) == own
    assert "forward" in vars(FakeEXL3) and fakes.view.own_off == 0 and pins.report()["applied"] == 2


def test_a_pinned_gemm_runs_every_step_at_the_bucket_and_a_row_comes_out_as_alone(fakes: SimpleNamespace) -> None:
    pins = seam_pins.LaunchPins(fakes.view, bucket=16)  # type: ignore[arg-type]
    lin, lin16 = FakeEXL3(64, 256), FakeFP16(64, 128)
    x = torch.randn(1, 5, 64)
    with pins.applied():
        y = FakeEXL3.forward(lin, x, {})
        y1 = FakeEXL3.forward(lin, x[:, 2:3].contiguous(), {})
        z = FakeFP16.forward(lin16, x, {})
        big = FakeEXL3.forward(lin, torch.randn(17, 64), {})  # more rows than the bucket: left as it was
        kept = FakeEXL3.forward(lin, x, {"reconstruct": True})
    assert torch.allclose(y, x @ lin.w + lin.bias, atol=1e-4) and y.shape == (1, 5, 256)
    assert torch.equal(y1[0, 0], y[0, 2])  # the row alone == the row beside four others (same launch, same rows)
    assert torch.allclose(z, x @ lin16.w, atol=1e-4) and FakeFP16.seen[-1] == 16
    assert fakes.ext.tried == [7, 2, 2] and fakes.ext.ran == [(16, 2), (16, 2)]  # 7 refused once, 2 kept
    assert big.shape == (17, 256) and torch.allclose(kept, x @ lin.w + lin.bias, atol=1e-4)
    report = pins.report()
    assert report["exl3_shapes"] == ["64x256: shape 2"] and "shape 7" in next(iter(report["exl3_shapes_refused"]))
    assert report["calls"] == {"EXL3 GEMM pinned": 2, "fp16 GEMM pinned": 1, "EXL3 GEMM left as it was": 2}


def test_a_shape_without_a_kernel_is_passed_over_not_left_as_an_unwritten_output(fakes: SimpleNamespace) -> None:
    pins = seam_pins.LaunchPins(fakes.view, bucket=16)  # type: ignore[arg-type]
    fakes.ext.without = {2}
    lin, x = FakeEXL3(32, 128), torch.randn(3, 32)
    with pins.applied():
        y = FakeEXL3.forward(lin, x, {})
    assert torch.allclose(y, x @ lin.w + lin.bias, atol=1e-4) and fakes.ext.ran == [(16, 1)]
    assert pins.report()["exl3_shapes"] == ["32x128: shape 1"]


def test_the_attention_gets_its_tables_split_plan_and_a_chosen_split_is_left_alone(fakes: SimpleNamespace) -> None:
    pins = seam_pins.LaunchPins(fakes.view, bucket=64)  # type: ignore[arg-type]
    cache, narrow, wide = torch.zeros(4, PAGE_SIZE, 2, 8), torch.zeros(3, 16), torch.zeros(3, 32)
    with pins.applied():
        decode = fakes.tp.paged_attn_triton_decode
        got = decode(k=torch.zeros(3, 1), k_cache=cache, block_table=wide)
        qc = decode(k=None, k_cache=cache, block_table=narrow, pre_appended_len=1)  # a quantized cache's call
        own = decode(k=None, k_cache=cache, block_table=narrow, num_splits=3)
    assert (got["num_splits"], got["max_kv_len"]) == split_plan(32, PAGE_SIZE, SPLIT_LEN, 1) == (32, 32 * 256 - 1)
    assert (qc["num_splits"], qc["max_kv_len"]) == (16, 16 * 256 - 1)
    assert own["num_splits"] == 3 and "max_kv_len" not in own
    assert pins.report()["calls"] == {"attention pinned": 2, "attention left as it was": 1}


def test_where_the_pins_cannot_hold_they_say_why(fakes: SimpleNamespace) -> None:
    assert seam_pins.pins_stand_aside(fakes.view) is None  # type: ignore[arg-type]
    fakes.attn.sliding_window = 4096
    assert "sliding-window" in (seam_pins.pins_stand_aside(fakes.view) or "")  # type: ignore[arg-type]
    fakes.attn.sliding_window = -1
    lora = FakeView([Linear()])
    lora.model.modules[0].lora_a_tensors = {"a": 1}
    assert "LoRA" in (seam_pins.pins_stand_aside(lora) or "")  # type: ignore[arg-type]
    assert "gptq weights" in (seam_pins.pins_stand_aside(FakeView([Linear("gptq")])) or "")  # type: ignore[arg-type]
    fakes.view.recurrent = ["GatedDeltaNet"]
    assert "recurrent" in (seam_pins.pins_stand_aside(fakes.view) or "")  # type: ignore[arg-type]
    fakes.view.why_not = "an MLP of kind BlockSparseMLP"
    assert "BlockSparseMLP" in (seam_pins.pins_stand_aside(fakes.view) or "")  # type: ignore[arg-type]


# ---------------------------------------------------------------------- the switch


class Gen:
    """Just enough of a Generator for the seam to hook (one page a forward, as deterministic=True needs)."""

    def __init__(self) -> None:
        self.max_chunk_size = self.shared_chunk_size = PAGE_SIZE
        self.pending_jobs: list[Any] = []
        self.active_jobs: list[Any] = []
        self.model = SimpleNamespace(forward=lambda **k: None, prefetch_tokens=lambda ids: None)
        self.cache = object()
        self.tokenizer = object()

    def iterate(self) -> list[Any]:
        return []

    def iterate_gen(self, results: list[Any], draft_tokens: Any = None) -> None:
        pass


def test_the_rows_run_apart_by_default_and_the_pinned_strategy_says_why_it_stood_aside(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fast_decode, "stands_aside", lambda: None)
    assert det.STRATEGY == det.ROWS_APART  # until the GPU proves the pinned one (docs/determinism.md)
    fast = fast_decode.FastDecode(Gen(), deterministic=True)
    assert fast.active and fast.report()["deterministic_strategy"] == "rows apart" and fast.pins is None
    fast.close()
    monkeypatch.setattr(det, "STRATEGY", det.PINNED)  # the one line that flips it
    fast = fast_decode.FastDecode(Gen(), deterministic=True)
    report = fast.report()
    assert report["deterministic_strategy"] == "rows apart" and fast.pins is None  # (no exllamav3 model here)
    assert report["pins_stand_aside"].startswith("the decode step is not captured")
    fast.close()
    assert fast_decode.FastDecode(Gen()).strategy is None  # not deterministic: neither strategy
