"""MoE layers in the captured decode step (``decode="fast"``): which row counts capture, and why the others do not.

exllamav3 1.6.5's ``BlockSparseMLP.forward`` serves up to 8 rows through its fused decode kernels (no host read) and
more rows through a sort path that reads the expert counts back on the host once ``rows x top_k`` passes the fused
kernel's row capacity (fast/seam/moe.py says where). The capture itself and greedy tokens identical to exllamav3's
own loop are proven on the GPU (tests/gpu/test_gpu_fast_moe.py); here, on the CPU, the decisions, through the model
view and :class:`DecodeGraphs` as a runtime builds them, over fakes of exllamav3's module kinds.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from fake_kinds import Kind, fake_model, install  # noqa: E402

from exllama_integrations.backends.exllamav3 import upstream  # noqa: E402
from exllama_integrations.backends.exllamav3.fast.graphs import DecodeGraphs  # noqa: E402
from exllama_integrations.backends.exllamav3.fast.seam.moe import (  # noqa: E402
    MoeLayer,
    _SyncFreeBincount,
    captured_rows,
    moe_layer,
    moe_report,
    why_eager,
)

from helpers import decode_step  # noqa: E402


class Embedding(Kind): ...


class TransformerBlock(Kind): ...


class Attention(Kind): ...


class BlockSparseMLP(Kind): ...


class RMSNorm(Kind): ...


def experts(**over: Any) -> BlockSparseMLP:
    """A loaded Qwen3-MoE-shaped layer: EXL3 experts (mul1: fused capacity 256 rows), top-8, on one device."""
    attrs: dict[str, Any] = {
        "key": "model.layers.0.mlp",
        "cpu_offload": False,
        "cpu_split_first": None,
        "routing_device": None,
        "tp_reduce": False,
        "routing_gate": object(),
        "router_type": "std",
        "bc": SimpleNamespace(sh_coop=False),
        "is_quantized": True,
        "num_experts_per_tok": 8,
        "fused_rows": 256,
        "fused_mode_buffers": object(),
        "bc_sh_exp": False,
        "config": SimpleNamespace(infer_params=SimpleNamespace(no_reconstruct=False)),
    }
    attrs.update(over)
    return BlockSparseMLP(**attrs)


def model(*mlps: Any) -> Any:
    blocks = [(TransformerBlock(attn=Attention(qsa_indexer=None), mlp=m, attn_hc=None, mlp_hc=None), i, None)
              for i, m in enumerate(mlps)]  # fmt: skip
    return fake_model(Embedding(), blocks, RMSNorm())


@pytest.fixture
def kinds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The boundary hands the fakes out as exllamav3's module kinds."""
    install(monkeypatch, Embedding, TransformerBlock, Attention, BlockSparseMLP, RMSNorm)


step = decode_step


def test_an_moe_model_is_captured_where_its_layers_need_no_host_read(kinds: None) -> None:
    """Before: any BlockSparseMLP stood the whole model aside ("an MLP of kind BlockSparseMLP")."""
    graphs = DecodeGraphs(model(experts(), experts(key="model.layers.1.mlp")), max_rows=64)
    assert graphs.why_not is None
    for rows in (1, 8, 9, 16, 32):  # fused decode kernels up to 8; the sort path up to 256 / 8 = 32 picks in capacity
        assert graphs.why_eager(*step(rows)) is None, rows
    why = graphs.why_eager(*step(33))
    assert why is not None and why.startswith("MoE layers ran eagerly (model.layers.0.mlp, model.layers.1.mlp)")
    assert "33 rows x top-8 = 264 expert picks > the fused kernel's 256 rows" in why
    assert "read back on the host" in why
    calls: list[int] = []
    graphs.forward(lambda i, p: calls.append(int(i.shape[0])) or "eager logits", *step(64))
    report = graphs.report()
    assert calls == [64] and report["captured"] is True
    assert report["moe"] == {
        "layers": 2,
        "captured_rows": "1-32",
        "eager_rows": "33-64",
        "eager_why": why_eager(graphs.view.moe, 33),
    }
    assert list(report["eager_forwards"]) == [why.replace("33 rows x top-8 = 264", "64 rows x top-8 = 512")]


def test_a_step_of_a_few_rows_is_captured_even_where_the_sort_path_always_reads_back(kinds: None) -> None:
    """Without fused expert buffers every sort-path step reads the counts back; the fused decode kernels do not."""
    graphs = DecodeGraphs(model(experts(fused_mode_buffers=None)), max_rows=16)
    assert [r for r in range(1, 17) if graphs.why_eager(*step(r)) is None] == list(range(1, 9))
    assert "no fused expert buffers" in str(graphs.why_eager(*step(9)))


def test_a_shared_expert_through_its_own_graph_keeps_the_few_row_steps_eager(kinds: None) -> None:
    shared = experts(bc_sh_exp=True, bc=SimpleNamespace(sh_coop=False))
    graphs = DecodeGraphs(model(shared), max_rows=16)
    assert "shared expert runs through exllamav3's own graph" in str(graphs.why_eager(*step(4)))
    assert graphs.why_eager(*step(16)) is None  # the sort path runs the shared expert as a plain GatedMLP
    coop = experts(bc_sh_exp=True, bc=SimpleNamespace(sh_coop=True))  # one more fused launch: captured
    assert DecodeGraphs(model(coop), max_rows=16).why_eager(*step(4)) is None


@pytest.mark.parametrize(
    ("over", "why"),
    [
        ({"cpu_offload": True}, "MoE experts on the CPU"),
        ({"cpu_split_first": 96}, "MoE experts on the CPU"),
        ({"routing_device": "cuda:1"}, "MoE routing or experts across devices"),
        ({"routing_gate": None}, "an MoE layer without a router on its device"),
        ({"router_type": "sqrtsp_hash"}, "hash-routed MoE (the step's token ids are read from the host)"),
        ({"bc": None}, "MoE experts not EXL3-quantized"),
        ({"is_quantized": False}, "MoE experts not EXL3-quantized"),
    ],
)
def test_an_moe_layer_no_step_of_which_can_be_captured_stands_the_model_aside(
    kinds: None, over: dict[str, Any], why: str
) -> None:
    graphs = DecodeGraphs(model(experts(), experts(**over)), max_rows=16)
    assert graphs.why_not is not None and graphs.why_not.startswith(why)
    assert graphs.report() == {"captured": False, "stands_aside": graphs.why_not}


def test_the_row_rule_follows_top_k_and_the_fused_capacity() -> None:
    small = MoeLayer("a", top_k=2, bszn_rows=8, fused_rows=256, always_sorted=False, shared_graph=False)
    wide = MoeLayer("b", top_k=8, bszn_rows=8, fused_rows=128, always_sorted=False, shared_graph=False)
    assert captured_rows([small], 200) == list(range(1, 129))  # top-2: 128 rows x 2 = 256 picks
    assert captured_rows([small, wide], 64) == list(range(1, 17))  # every layer must capture
    sorted_only = MoeLayer("c", top_k=8, bszn_rows=8, fused_rows=128, always_sorted=True, shared_graph=False)
    assert captured_rows([sorted_only], 64) == list(range(1, 17))  # no_reconstruct: the sort path at every count
    assert moe_report([wide], 20) == {
        "layers": 1,
        "captured_rows": "1-16",
        "eager_rows": "17-20",
        "eager_why": "MoE layers ran eagerly (b): 17 rows x top-8 = 136 expert picks > the fused kernel's 128 rows: "
        "its expert counts are read back on the host (block_sparse_mlp.py:1201)",
    }
    layer = moe_layer(experts(config=SimpleNamespace(infer_params=SimpleNamespace(no_reconstruct=True))), 8)
    assert isinstance(layer, MoeLayer) and layer.always_sorted


def test_the_sync_free_bincount_gives_torchs_counts() -> None:
    proxy = _SyncFreeBincount(torch)
    g = torch.Generator().manual_seed(0)
    for n, e in ((1, 4), (64 * 8, 128), (37, 9)):
        x = torch.randint(0, e + 1, (n,), generator=g)  # expert ids, E the sentinel of out-of-slice picks
        got = proxy.bincount(x, minlength=e + 1)
        want = torch.bincount(x, minlength=e + 1)
        assert got.dtype == want.dtype == torch.long and torch.equal(got, want)
    w = torch.rand(5, generator=g)
    assert torch.equal(proxy.bincount(torch.arange(5), weights=w), torch.bincount(torch.arange(5), weights=w))
    assert proxy.argsort is torch.argsort  # everything else is torch's own


def test_inside_a_capture_the_moe_module_counts_without_a_host_read_and_gets_torch_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from exllama_integrations.backends.exllamav3.fast.seam.moe import sync_free_bincount

    bsm = SimpleNamespace(torch=torch)  # exllamav3's block_sparse_mlp module, as far as its globals go
    monkeypatch.setitem(vars(upstream), "module", lambda name: bsm if name.endswith(".block_sparse_mlp") else None)
    with sync_free_bincount():
        assert isinstance(bsm.torch, _SyncFreeBincount)
        assert torch.equal(bsm.torch.bincount(torch.tensor([2, 0, 2]), minlength=4), torch.tensor([1, 0, 2, 0]))
    assert bsm.torch is torch


def test_an_mrope_models_text_steps_are_captured_and_an_offset_step_is_not(kinds: None) -> None:
    """Qwen3 and Qwen3-MoE declare MRoPE, so exllamav3's generator hands every step per-row positions: the cache
    length plus the job's rope offset, 0 for text. Before, such a model stood aside whole ("MRoPE positions") and each
    step as "explicit positions"."""
    qwen3_moe = model(experts())
    qwen3_moe.caps = {"mrope": True}
    graphs = DecodeGraphs(qwen3_moe, max_rows=16)
    assert graphs.why_not is None
    ids, params = step(4)
    params["positions"] = params["cache_seqlens"].clone()  # a text job: offset 0
    assert graphs.why_eager(ids, params) is None
    params["positions"] = params["cache_seqlens"] + torch.tensor([0, 0, 7, 0], dtype=torch.int32)  # an image job's
    assert graphs.why_eager(ids, params) == "explicit positions"
    params["positions"] = params["cache_seqlens"].clone()
    params["position_ids"] = torch.zeros((4, 1), dtype=torch.long)
    assert graphs.why_eager(ids, params) == "explicit positions"


def test_at_load_only_the_row_counts_whose_moe_layers_capture_are_captured(
    kinds: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``warmup=True`` captures every row count up to the batch at load: an MoE model's that would read back, not."""
    graphs = DecodeGraphs(model(experts()), max_rows=64)
    captured: list[int] = []
    monkeypatch.setattr(graphs, "_capture", lambda key, x, params, out: captured.append(key[0]) or object())
    done = graphs.capture_at_load(lambda ids, params: "logits", cache=object(), rows=range(1, 65), progress=False)
    assert captured == list(range(1, 33)) and done == 32
