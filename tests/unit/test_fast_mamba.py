"""Mamba-2 layers (exllamav3's ``Mamba2``: Nemotron-H) in the captured decode step.

Greedy tokens identical to exllamav3's own loop are proven on the GPU (tests/gpu/test_gpu_fast_mamba.py); here, on the
CPU: which models capture their Mamba-2 layers and from how many rows (through the model view and
:class:`DecodeGraphs` as a runtime builds them, over fakes of exllamav3's module kinds), and the exactness argument
itself: exllamav3 1.6.5's own ``Mamba2.forward``, ``prepare_for_recurrence`` and ``advance_recurrent_states`` read from
its source (its CUDA kernels stood in for by the source's own torch references of them, each on the rows its slot
tensors name), stepped through :class:`DecodeGraphs` with a stand-in for CUDA graph capture (the capture records and
leaves the state alone; a replay runs the recorded forward again over the same static inputs), give every step's
output and every pool row bit for bit as exllamav3's eager forward does, over rows that join and leave on different
steps, hold slots out of row order and scan rows of either parity.
"""

from __future__ import annotations

import ast
import os
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from fake_kinds import Kind, fake_model, install  # noqa: E402

from exllama_integrations.backends.exllamav3 import upstream  # noqa: E402
from exllama_integrations.backends.exllamav3.fast import graphs as graphs_module  # noqa: E402
from exllama_integrations.backends.exllamav3.fast.graphs import DecodeGraphs  # noqa: E402

from helpers import decode_step  # noqa: E402


class Embedding(Kind):
    def forward(self, ids: Any, params: dict[str, Any]) -> Any:
        return self.table[ids]  # [rows, 1, hidden]


class TransformerBlock(Kind):
    def forward(self, x: Any, params: dict[str, Any]) -> Any:  # a block's attention half: x + mixer(x)
        return x + self.attn.forward(x, params)


class Mamba2(Kind): ...


class Attention(Kind): ...


class GatedDeltaNet(Kind): ...


class RMSNorm(Kind):
    def forward(self, x: Any, params: dict[str, Any]) -> Any:  # (the final norm and head, as one module here)
        return x @ self.head


@pytest.fixture
def kinds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The boundary hands the fakes out as exllamav3's module kinds."""
    install(monkeypatch, Embedding, TransformerBlock, Attention, Mamba2, GatedDeltaNet, RMSNorm)


def mamba(idx: int, heads: int = 8, bc: Any = None, **over: Any) -> Mamba2:
    """A Nemotron-H-shaped Mamba-2 mixer's attributes (``bc``: a ``BC_Mamba2``, which exllamav3 builds for EXL3)."""
    return Mamba2(**{"layer_idx": idx, "num_v_heads": heads, "num_k_heads": 2, "bc": bc, "tp_reduce": False,
                     "has_split_cache": False, **over})  # fmt: skip


def model(*attns: Any) -> Any:
    blocks = [(TransformerBlock(attn=a, mlp=None, attn_hc=None, mlp_hc=None), i + 1, None)
              for i, a in enumerate(attns)]  # fmt: skip
    return fake_model(Embedding(), blocks, RMSNorm())


def nemotron_h_like(bc: Any = None) -> Any:
    """Nemotron-H's pattern, its MLP layers left out: Mamba-2 layers with an attention layer among them."""
    return model(*[mamba(i, bc=bc) if i % 4 != 2 else Attention(qsa_indexer=None) for i in range(8)])


def test_a_mamba2_model_is_captured_above_exllamav3s_own_graphed_rows(kinds: None) -> None:
    """EXL3 weights (a ``BC_Mamba2`` per layer): up to 8 rows exllamav3's own graphed layers run, above it the whole
    step is captured. Before: any Mamba2 stood the model aside for its life ("an attention layer of kind Mamba2")."""
    graphs = DecodeGraphs(nemotron_h_like(bc=object()), max_rows=64, recurrent=True)
    assert graphs.why_not is None
    assert graphs.min_rows == 9
    for rows in (9, 16, 64):
        ids, params = decode_step(rows, recurrent_states=[object()] * rows)
        assert graphs.why_eager(ids, params) is None, rows
    ids, params = decode_step(8, recurrent_states=[object()] * 8)
    assert graphs.why_eager(ids, params) == "up to 8 rows (left to exllamav3's own per-layer graphs)"
    ids, params = decode_step(16, recurrent_states=[object()] * 16, recurrent_history=True)
    assert graphs.why_eager(ids, params) == "image embeddings or a speculative pass"
    report = graphs.report()
    assert report["captured"] is True and report["recurrent_layers"] == {"Mamba2": 6}
    assert report["min_rows"] == 9
    # (fast_recurrent=False: such a model stands aside, as before)
    assert DecodeGraphs(nemotron_h_like(), max_rows=64, recurrent=False).why_not == "an attention layer of kind Mamba2"


def test_without_its_own_graphs_a_mamba2_model_is_captured_from_one_row(kinds: None) -> None:
    """fp16 / bf16 weights: no ``BC_Mamba2``, exllamav3's torch path at every row count, so every row count is
    captured (a Gated DeltaNet model keeps 8: its fused split path is taken on other conditions)."""
    graphs = DecodeGraphs(nemotron_h_like(bc=None), max_rows=64, recurrent=True)
    assert graphs.why_not is None and graphs.min_rows == 1
    for rows in (1, 2, 8, 16, 64):
        ids, params = decode_step(rows, recurrent_states=[object()] * rows)
        assert graphs.why_eager(ids, params) is None, rows


@pytest.mark.parametrize(
    ("layer", "why"),
    [
        (mamba(0, heads=1), "a Mamba-2 layer of one head (its decode step reads its state rows on the host)"),
        (mamba(0, num_k_heads=0), "a Mamba-2 layer without heads on this device"),
        (mamba(0, tp_reduce=True), "a tensor-parallel Mamba-2 layer"),
    ],
)
def test_mamba2_layers_whose_step_is_not_capturable_stand_the_model_aside(kinds: None, layer: Any, why: str) -> None:
    graphs = DecodeGraphs(model(layer, Attention(qsa_indexer=None)), max_rows=16, recurrent=True)
    assert graphs.why_not == why


# ---------------------------------------------------------------------- exactness, against exllamav3's own source


def source_functions(path: str, names: dict[str, str | None], scope: dict[str, Any]) -> dict[str, Any]:
    """The functions ``names`` (function name -> its class, or None at module level) of the exllamav3 source file
    ``path`` under ``EXLLAMAV3_SOURCE``, compiled in ``scope``."""
    source = os.environ.get("EXLLAMAV3_SOURCE")
    if not source:
        pytest.skip("set EXLLAMAV3_SOURCE to an unpacked exllamav3 1.6.5 wheel (pip download exllamav3==1.6.5)")
    text = (Path(source) / "exllamav3" / path).read_text()
    body = ast.parse(text).body
    fns = []
    for name, cls in names.items():
        where = next(n.body for n in body if isinstance(n, ast.ClassDef) and n.name == cls) if cls else body
        fn = next(n for n in where if isinstance(n, ast.FunctionDef) and n.name == name)
        fn.decorator_list = []  # (@override)
        fns.append(fn)
    exec(compile(ast.Module(fns, []), path, "exec"), scope)  # noqa: S102 - exllamav3's own code
    return {name: scope[name] for name in names}


class Kernels:
    """exllamav3's extension calls of a Mamba-2 decode step, as its own torch references of them compute them (the
    source's ``causal_conv1d_update_function_torch`` and ``torch_recurrent_mamba2``) on the slots the step names; each
    call's slot and pool tensors are noted, to see which tensors a replay reads."""

    def __init__(self, conv_ref: Any, scan_ref: Any) -> None:
        self.conv_ref, self.scan_ref = conv_ref, scan_ref
        self.calls: list[tuple[str, int, int]] = []  # (kernel, slot tensor's address, pool's address)

    def mamba2_dt_op(self, dt_raw: Any, dt_bias: Any, a_log: Any, dt: Any, g: Any, lo: float, hi: float) -> None:
        """(gdn.cu's ``mamba2_dt_op_kernel``, line for line: it has no torch reference in the source)"""
        v = torch.nn.functional.softplus(dt_raw + dt_bias).clamp(lo, hi)
        g.copy_(-torch.exp(a_log) * v)
        dt.copy_(v.to(torch.bfloat16))

    def causal_conv1d_update(self, mixed_qkv: Any, conv_state: Any, recurrent_slots: Any, conv1d_weight: Any,
                             conv1d_bias: Any, history: bool = False, params: Any = None, incremental: bool = False,
                             ) -> Any:  # fmt: skip
        assert not history and not incremental
        self.calls.append(("conv", recurrent_slots.data_ptr(), conv_state.data_ptr()))
        rows = recurrent_slots.long()
        state = conv_state[rows]
        y = self.conv_ref(mixed_qkv, state, conv1d_weight, conv1d_bias)
        conv_state[rows] = state
        return y.transpose(1, 2).contiguous()

    def cuda_recurrent_mamba2(self, mixed_xbc: Any, g: Any, dt: Any, d: Any, pool: Any, out: Any, nk: int, nv: int,
                              kd: int, vd: int, slots: Any, history: bool, slots_in: Any) -> None:  # fmt: skip
        assert not history and slots_in is None
        self.calls.append(("scan", slots.data_ptr(), pool.data_ptr()))
        rows = slots.long()
        y, state = self.scan_ref(mixed_xbc, dt, g, d, pool[rows, 0], nk, nv, kd, vd)
        pool[rows, 0] = state
        out.copy_(y.to(out.dtype))


HIDDEN, HEADS, HEAD_DIM, GROUPS, STATE, KERNEL, VOCAB, SLOTS = 32, 4, 8, 2, 16, 4, 48, 6


def mamba2_model(seed: int, forward: Any, norm: Any) -> tuple[Any, Any, dict[tuple[int, int], Any]]:
    """Two Mamba-2 blocks (exllamav3's ``Mamba2.forward`` over seeded weights), their cache's pools, an embedding and a
    head; returns the model, the cache and the pools by layer."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.3) -> Any:
        return torch.randn(shape, generator=gen) * scale

    class Linear:
        def __init__(self, w: Any) -> None:
            self.w = w

        def forward(self, x: Any, params: Any) -> Any:
            return x.float() @ self.w

    v_dim, k_dim = HEADS * HEAD_DIM, GROUPS * STATE
    fdim = v_dim + 2 * k_dim
    pools: dict[tuple[int, int], Any] = {}
    layers = []
    for idx in (0, 1):
        m = mamba(idx, heads=HEADS, num_k_heads=GROUPS, k_head_dim=STATE, v_head_dim=HEAD_DIM,
                  num_v_groups=HEADS // GROUPS, v_dim=v_dim, k_dim=k_dim, fdim_qkv=fdim, dt_limit=(0.0, float("inf")),
                  out_dtype=torch.float, tp_dt_first=0, derived_filled=False, tp_recurrent_lookup={}, device="cpu",
                  in_proj=Linear(rand(HIDDEN, v_dim + fdim + HEADS)), o_proj=Linear(rand(v_dim, HIDDEN)),
                  a_log=rand(HEADS), dt_bias=rand(HEADS), d_skip=rand(HEADS), conv1d_weight=rand(fdim, 1, KERNEL),
                  conv1d_bias=rand(fdim).to(torch.bfloat16), a_log_f=torch.empty(HEADS),
                  dt_bias_f=torch.empty(HEADS), d_skip_f=torch.empty(HEADS),
                  conv1d_weight_flat=torch.empty((fdim, KERNEL), dtype=torch.bfloat16))  # fmt: skip
        weight = 1 + rand(v_dim)
        m.norm = SimpleNamespace(forward=lambda x, params, gate, w=weight: norm(
            SimpleNamespace(gate_first=True, weight=w, groups=GROUPS, rms_norm_eps=1e-5, out_dtype=torch.half),
            x, params, gate=gate))  # fmt: skip
        m.forward = forward.__get__(m)  # exllamav3's own Mamba2.forward
        conv = torch.zeros((SLOTS, fdim, KERNEL), dtype=torch.bfloat16)
        pool = torch.zeros((2 * SLOTS, 1, HEADS, STATE, HEAD_DIM))
        pools[(idx, idx + 1)] = (conv, pool)
        layers.append(m)
    cache = SimpleNamespace(
        get_recurrent_layer=lambda key: SimpleNamespace(get_state_tensors=lambda: pools[key]),
    )
    m = model(*layers)
    m.fwd_modules[0][0].table = rand(VOCAB, HIDDEN, scale=1.0)
    m.fwd_modules[-1][0].head = rand(HIDDEN, VOCAB)
    return m, cache, pools


@contextmanager
def cuda_graphs_on_the_cpu(monkeypatch: pytest.MonkeyPatch, pools: dict[Any, Any]) -> Any:
    """torch.cuda's graph calls for :class:`DecodeGraphs`, on the CPU: a capture records the forward run inside it
    and leaves the state as it was (a capture runs nothing); ``replay()`` runs that forward again over the same
    static inputs and writes the static logits, as the graph's kernels would."""
    capturing: list[Any] = []

    class Graph:
        def __init__(self) -> None:
            self.recorded: tuple[Any, Any, Any, Any] | None = None

        def replay(self) -> None:
            run, x, static, logits = self.recorded  # type: ignore[misc]
            logits.copy_(run(x, static))

        def reset(self) -> None:
            self.recorded = None

    @contextmanager
    def graph(g: Graph, **_: Any) -> Any:
        kept = {k: (c.clone(), p.clone()) for k, (c, p) in pools.items()}
        capturing.append(g)
        try:
            yield
        finally:
            capturing.pop()
            for k, (c, p) in kept.items():
                pools[k][0].copy_(c)
                pools[k][1].copy_(p)

    def recording(view: Any) -> Any:
        """``view.run_layers``, each run inside a capture recorded in its graph."""
        own = view.run_layers

        def run(x: Any, static: dict[str, Any]) -> Any:
            if capturing:  # (the graph writes its output where the capture copied it: the static logits' rows)
                logits = view.static.logits[: int(x.shape[0])]
                capturing[-1].recorded = (own, x, static, logits)
            return own(x, static)

        return run

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(graphs_module, "capture_stream", lambda device: None)
    yield recording


def run_schedule(captured: bool, monkeypatch: pytest.MonkeyPatch, steps: int = 48) -> tuple[list[Any], Any, Any]:
    """``steps`` decode steps of up to 5 jobs joining and leaving on different steps, each holding a slot out of row
    order and a scan row of either parity; returns each step's logits, the pools at the end, and the kernels' calls,
    the graphs and each job's (position, steps it was live)."""
    tensor = {"no_default": object(), "to_device": lambda v, device, non_blocking=False: v.to(device)}
    util = source_functions("util/tensor.py", {"get_for_device": None, "to2": None}, {"torch": torch, **tensor})
    rec = source_functions(
        "cache/recurrent_util.py",
        {"_get_slot_tensor": None, "prepare_for_recurrence": None, "advance_recurrent_states": None},
        {"torch": torch, "_slot_tensors": {}},
    )
    refs = source_functions(
        "modules/mamba2.py", {"torch_recurrent_mamba2": None}, {"torch": torch}
    ) | source_functions(
        "modules/gated_delta_net_fn/conv1d.py", {"causal_conv1d_update_function_torch": None},
        {"torch": torch, "F": torch.nn.functional},
    )  # fmt: skip
    kernels = Kernels(refs["causal_conv1d_update_function_torch"], refs["torch_recurrent_mamba2"])
    scope = {"torch": torch, "ext": kernels, "causal_conv1d_update": kernels.causal_conv1d_update,
             "_BC_MAX_BSZ": 8, "_BC_MAX_QLEN": 16, **util}  # fmt: skip
    forward = source_functions("modules/mamba2.py", {"forward": "Mamba2"}, scope)["forward"]
    norm = source_functions("modules/gated_rmsnorm.py", {"forward_torch": "GatedRMSNorm"}, {"torch": torch,
                            "F": torch.nn.functional})["forward_torch"]  # fmt: skip
    m, cache, pools = mamba2_model(5, forward, norm)
    m.prepare_inputs = lambda ids, params: (rec["prepare_for_recurrence"](ids, params, m), ids)[1]
    monkeypatch.setitem(vars(upstream), "get_for_device", util["get_for_device"])
    monkeypatch.setitem(vars(upstream), "advance_recurrent_states", rec["advance_recurrent_states"])
    monkeypatch.setattr(upstream, "module", lambda name: SimpleNamespace(_bc_attn_enable=True))

    def eager(ids: Any, params: dict[str, Any]) -> Any:  # exllamav3's Model.forward: prepare, the layers, advance
        x = m.prepare_inputs(ids, params)
        for module, instance, _ in m.fwd_modules:
            params["layer_instance"] = instance
            x = module.forward(x, params)
        rec["advance_recurrent_states"](ids, params, m)
        return x

    jobs = [  # (slot, parity, first step, last step)
        SimpleNamespace(slot=4, parity=0, first=0, last=40),
        SimpleNamespace(slot=1, parity=1, first=3, last=47),
        SimpleNamespace(slot=5, parity=1, first=6, last=30),
        SimpleNamespace(slot=0, parity=0, first=9, last=47),
        SimpleNamespace(slot=2, parity=1, first=24, last=47),
    ]
    states = {j.slot: SimpleNamespace(slot=j.slot, parity=j.parity, position=0, last_history=0, exported=False,
                                      cache=cache, spec_row=None, post_advance=lambda: None) for j in jobs}  # fmt: skip
    outputs = []
    with cuda_graphs_on_the_cpu(monkeypatch, pools) as recording:
        graphs = DecodeGraphs(m, max_rows=8, recurrent=True, ahead=False)
        assert graphs.why_not is None, graphs.why_not
        graphs.view.device = "cpu"  # (the fakes' blocks say cuda: the view's own check)
        graphs.view.run_layers = recording(SimpleNamespace(run_layers=graphs.view.run_layers, static=graphs.static))
        for step in range(steps):
            live = [j for j in jobs if j.first <= step <= j.last]
            rs = [states[j.slot] for j in live]
            ids, params = decode_step(len(live), recurrent_states=rs, cache=cache)
            params.pop("dev_cache")  # (exllamav3's step has none until get_for_device makes one)
            params["cache_seqlens"] = torch.tensor([r.position for r in rs], dtype=torch.int32)
            ids = torch.tensor([[(7 * j.slot + 3 * step) % VOCAB] for j in live])
            out = graphs.forward(eager, ids, params) if captured else eager(ids, params)
            outputs.append(out.clone())
    return outputs, pools, (kernels.calls, graphs, [(states[j.slot].position, j.last + 1 - j.first) for j in jobs])


def test_the_captured_mamba2_step_is_exllamav3s_own_step_by_step(kinds: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: DecodeGraphs stood such a model aside ("an attention layer of kind Mamba2"), never replaying."""
    want, want_pools, _ = run_schedule(False, monkeypatch)
    got, got_pools, (calls, graphs, positions) = run_schedule(True, monkeypatch)
    assert all(p == live for p, live in positions), positions  # each state advanced once a step it was live
    report = graphs.report()
    assert report["recurrent_layers"] == {"Mamba2": 2}
    assert len(graphs.captured) == 5 and graphs.replays == 48 - 5  # rows 1..5: each shape's first step ran eagerly
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), step
    for key in want_pools:
        assert torch.equal(got_pools[key][0], want_pools[key][0]), key  # conv rings
        assert torch.equal(got_pools[key][1], want_pools[key][1]), key  # scan pools (both parities' rows)
    # the rows nobody holds stayed zero, and each job's scan row of the other parity too: no step wrote outside its own
    touched = {2 * s + p for s, p in ((4, 0), (1, 1), (5, 1), (0, 0), (2, 1))}
    for key, (_, pool) in got_pools.items():
        assert all(bool(pool[r].any()) == (r in touched) for r in range(2 * SLOTS)), key
    # every replay's kernels read the static slot tensors (the graph's), not the step's own
    st = graphs.static
    static = {st.slots.data_ptr(), st.slots_scan.data_ptr()}
    last = calls[-4:]  # the last step (3 rows, replayed): each layer's conv and scan
    assert [k for k, _, _ in last] == ["conv", "scan"] * 2
    assert {ptr for _, ptr, _ in last} <= static, last
    assert {pool for _, _, pool in last} == {t.data_ptr() for both in got_pools.values() for t in both}  # the cache's
