"""Sliding-window rings (exllamav3's ``SlidingAttention``: gpt-oss, Gemma 4, MiMo-V2) in the captured decode step.

The capture and greedy tokens identical to exllamav3's own loop are proven on the GPU
(tests/gpu/test_gpu_fast_rings.py); here, on the CPU: which models capture their ring layers (through the model view
and :class:`DecodeGraphs` as a runtime builds them, over fakes of exllamav3's module kinds), and the exactness argument
itself, against exllamav3 1.6.5's own ``SlidingAttention._decode_state_prep`` read from its source: many decode steps
of rows that join at different steps and cross their ring's end at different steps, run as exllamav3's forward runs
them (each layer shifts, then its kernel reads the table and lengths it returned) and as the captured step runs them
(shifts before the replay, one static table and lengths for every layer), give the same rings, the same states and
the same attended keys.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from fake_kinds import Kind, fake_model, install  # noqa: E402

from exllama_integrations.backends.exllamav3 import upstream  # noqa: E402
from exllama_integrations.backends.exllamav3.fast.graphs import DecodeGraphs  # noqa: E402
from exllama_integrations.backends.exllamav3.fast.seam.pins import pins_stand_aside  # noqa: E402
from exllama_integrations.backends.exllamav3.fast.seam.rings import Rings  # noqa: E402

from helpers import decode_step  # noqa: E402

PAGE = 256


class Embedding(Kind): ...


class TransformerBlock(Kind): ...


class Attention(Kind): ...


class SlidingAttention(Kind): ...


class GatedDeltaNet(Kind): ...


class GatedMLP(Kind): ...


class RMSNorm(Kind): ...


@pytest.fixture
def kinds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The boundary hands the fakes out as exllamav3's module kinds."""
    install(monkeypatch, Embedding, TransformerBlock, Attention, SlidingAttention, GatedDeltaNet, GatedMLP, RMSNorm)


def ring(idx: int, window: int = 127, size: int = 768, **over: Any) -> SlidingAttention:
    """A Gemma-4-shaped local layer: window 127 (HF's 128 less the query), ring = window + 512 rounded to pages."""
    attrs = {"layer_idx": idx, "sliding_window": window, "kv_state_size": size, "window_right": 0, "num_kv_heads": 2}
    return SlidingAttention(**{**attrs, **over})


def model(*attns: Any) -> Any:
    blocks = [(TransformerBlock(attn=a, mlp=GatedMLP(), attn_hc=None, mlp_hc=None), i + 1, None)
              for i, a in enumerate(attns)]  # fmt: skip
    return fake_model(Embedding(), blocks, RMSNorm())


def gemma4_like() -> Any:
    """Gemma 4's pattern: five local layers (rings) to one global (plain attention over the paged cache)."""
    return model(*[ring(i) if i % 6 != 5 else Attention(qsa_indexer=None, sliding_window=-1) for i in range(12)])


def test_a_ring_model_is_captured_at_every_row_count(kinds: None) -> None:
    """Before: any SlidingAttention stood the whole model aside for its life ("an attention layer of kind
    SlidingAttention"), so gpt-oss and Gemma 4 ran exllamav3's own loop at every step."""
    graphs = DecodeGraphs(gemma4_like(), max_rows=64, recurrent=True)
    assert graphs.why_not is None
    assert graphs.min_rows == 1  # (a ring's own graphed step stands aside inside a capture, as attention's does)
    for rows in (1, 2, 8, 9, 16, 64):
        ids, params = decode_step(rows, recurrent_states=[object()] * rows)
        assert graphs.why_eager(ids, params) is None, rows
    ids, params = decode_step(16, recurrent_states=[object()] * 16, recurrent_history=True)
    assert graphs.why_eager(ids, params) == "image embeddings or a speculative pass"
    assert graphs.why_eager(*decode_step(16)) == "a sliding-window step without its ring states"
    report = graphs.report()
    assert report["captured"] is True and report["recurrent_layers"] == {}
    assert report["rings"] == {"layers": 10, "ring_tokens": 768, "window": 127, "row_shifts": 0}


def test_without_fast_recurrent_a_ring_model_stands_aside_as_before(kinds: None) -> None:
    graphs = DecodeGraphs(gemma4_like(), max_rows=64, recurrent=False)
    assert graphs.why_not == "an attention layer of kind SlidingAttention"
    assert graphs.report() == {"captured": False, "stands_aside": graphs.why_not}


@pytest.mark.parametrize(
    ("attns", "why"),
    [
        ((ring(0), ring(1, window=1023, size=1536)), "sliding-window rings of several sizes ([768, 1536] tokens)"),
        ((ring(0, window_right=15),), "a sliding-window layer that looks ahead (window_right: a block drafter)"),
        ((ring(0, num_kv_heads=0),), "a sliding-window layer without K/V heads on this device"),
        ((ring(0), GatedDeltaNet(kda=False)), "sliding-window rings beside recurrent layers"),
    ],
)
def test_rings_whose_step_is_not_exllamav3s_one_shift_stand_the_model_aside(
    kinds: None, attns: tuple[Any, ...], why: str
) -> None:
    graphs = DecodeGraphs(model(*attns), max_rows=16, recurrent=True)
    assert graphs.why_not == why


def test_plain_attention_with_a_window_over_the_paged_cache_is_captured(kinds: None) -> None:
    """Gemma 2/3, Cohere2, OLMo3: ``Attention`` with ``sliding_window`` > 0 reads its window as a kernel constant
    (attn.py passes ``window_size=self.sliding_window`` to the paged decode kernel; no host value): captured, with
    the batched step at every row count (a coverage pin: it held before this change too)."""
    windowed = model(*[Attention(qsa_indexer=None, sliding_window=1023 if i % 2 else -1) for i in range(6)])
    for recurrent in (False, True):
        graphs = DecodeGraphs(windowed, max_rows=64, recurrent=recurrent)
        assert graphs.why_not is None and graphs.min_rows == 1
        assert all(graphs.why_eager(*decode_step(rows)) is None for rows in (1, 8, 16, 64))
        assert "rings" not in graphs.report()


def test_the_pinned_strategy_stands_aside_for_rings(kinds: None) -> None:
    """deterministic=True's pins wrap triton_paged's decode function; sliding_attn calls its own import of it."""
    view = DecodeGraphs(gemma4_like(), max_rows=16, recurrent=True).view
    assert pins_stand_aside(view) == "sliding-window rings (their attention's splits are not pinned)"


def test_inside_a_capture_ring_layers_read_the_static_tensors_and_their_own_graphs_stand_aside(
    kinds: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    swa_module = SimpleNamespace(_bc_attn_enable=True)
    monkeypatch.setattr(upstream, "module", lambda name: swa_module if name.endswith(".sliding_attn") else None)
    layers = [ring(0), ring(1)]
    rings = Rings([(m, 1) for m in layers])
    tables, lengths = torch.zeros((4, 3), dtype=torch.int32), torch.zeros((4,), dtype=torch.int32)
    with rings.read_static(tables, lengths):
        assert swa_module._bc_attn_enable is False
        for m in layers:
            got = m._decode_state_prep([object()] * 4, None, None, 1)
            assert got[0] is tables and got[1] is lengths
        with pytest.raises(RuntimeError, match="2 positions a row"):
            layers[0]._decode_state_prep([object()] * 4, None, None, 2)
    assert swa_module._bc_attn_enable is True
    assert all("_decode_state_prep" not in vars(m) for m in layers)


class SlicedMultiLinear(Kind): ...


def test_a_ring_models_sliced_qkv_gets_the_capturable_pointer_table(
    kinds: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """exllamav3's own ``SlicedMultiLinear.c_ptrs`` uploads its table with a pageable copy, which a capture refuses: the
    seam gives every sliced Q/K/V GEMM of a captured model its pinned table. Before: only a model the view captured
    without ``recurrent`` got it, so a ring (or GDN) model's EXL3 attention at 2-32 rows would fail its capture."""
    from exllama_integrations.backends.exllamav3.fast.seam import Seam

    monkeypatch.setitem(vars(upstream), "SlicedMultiLinear", SlicedMultiLinear)
    mq = SlicedMultiLinear()
    local = ring(0, multi_qkv=mq)
    m = model(local, Attention(qsa_indexer=None, sliding_window=-1, multi_qkv=None))
    m.modules = [blk for blk, _, _ in m.fwd_modules[1:3]]
    for blk in m.modules:
        blk.modules = [blk.attn]
    m.forward, m.prefetch_tokens = (lambda *a, **k: None), (lambda ids: None)
    gen = SimpleNamespace(model=m, cache=object(), iterate=lambda: None, iterate_gen=lambda r, d=None: None)
    table = object()
    seam = Seam(gen)
    seam.install(SimpleNamespace(), prefill=False, pointer_table=lambda got: table if got is mq else None)  # type: ignore[arg-type]
    assert vars(mq).get("c_ptrs") is table
    seam.remove()
    assert "c_ptrs" not in vars(mq)


# ---------------------------------------------------------------------- exactness, against exllamav3's own source


def exllamav3_decode_state_prep() -> Any:
    """``SlidingAttention._decode_state_prep`` of the exllamav3 source under ``EXLLAMAV3_SOURCE``, as a function
    (its module's names it uses: torch, PAGE_SIZE, host_to_device, which on the CPU is ``t.to(device)``)."""
    source = os.environ.get("EXLLAMAV3_SOURCE")
    if not source:
        pytest.skip("set EXLLAMAV3_SOURCE to an unpacked exllamav3 1.6.5 wheel (pip download exllamav3==1.6.5)")
    text = (Path(source) / "exllamav3" / "modules" / "sliding_attn.py").read_text()
    cls = next(n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == "SlidingAttention")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "_decode_state_prep")
    scope: dict[str, Any] = {"torch": torch, "PAGE_SIZE": PAGE, "host_to_device": lambda t, device: t.to(device)}
    exec(compile(ast.Module([fn], []), "sliding_attn.py", "exec"), scope)  # noqa: S102 - exllamav3's own code
    return scope["_decode_state_prep"]


class RingLayer:
    """One local layer: its ring (``SWALayerState``'s K/V, one head of one value) and exllamav3's host part."""

    def __init__(self, idx: int, prep: Any, slots: int, size: int, window: int) -> None:
        self.layer_idx, self.kv_state_size, self.sliding_window = idx, size, window
        self.window_right, self.num_kv_heads, self.device, self.bt_cache = 0, 1, "cpu", {}
        self.k = torch.zeros((slots, size, 1, 1))
        self.v = torch.zeros((slots, size, 1, 1))
        self._prep = prep

    def _decode_state_prep(self, rsg: Any, k_states: Any, v_states: Any, seqlen: int) -> Any:
        return self._prep(self, rsg, k_states, v_states, seqlen)

    def kernel(self, table: Any, lengths: Any, new: list[float]) -> list[list[float]]:
        """What ``paged_attn_triton_decode`` does with them: append each row's key at its length (through its page
        table) and attend over the window ending there; the keys attended, per row."""
        flat = self.k.view(-1)
        seen = []
        for i, value in enumerate(new):
            n, row = int(lengths[i]), [int(p) for p in table[i]]
            flat[row[n // PAGE] * PAGE + n % PAGE] = value
            where = [row[j // PAGE] * PAGE + j % PAGE for j in range(max(0, n - self.sliding_window), n + 1)]
            seen.append(flat[torch.tensor(where)].tolist())
        return seen


def run_steps(captured: bool, steps: int = 1400, rows: int = 5) -> tuple[list[Any], list[Any], list[Any], int]:
    """``steps`` decode steps of ``rows`` rows (row i joins at step 131 * i) over two local layers."""
    prep = exllamav3_decode_state_prep()
    size, window = 768, 127
    layers = [RingLayer(i, prep, rows, size, window) for i in (0, 2)]
    cache = SimpleNamespace(get_recurrent_layer=lambda key: SimpleNamespace(
        get_state_tensors=lambda: (layers[key[0] // 2].k, layers[key[0] // 2].v)))  # fmt: skip
    states = [SimpleNamespace(slot=r, position=0, window_beg=0, wshift=0, cache=cache) for r in range(rows)]
    rings = Rings([(m, 0) for m in layers])
    attended: list[Any] = []
    for step in range(steps):
        live = [rs for rs in states if step >= 131 * rs.slot]
        new = [float(rs.slot * 10_000 + rs.position + 1) for rs in live]  # the key each row appends: its token
        if captured:  # before the replay: the shifts and the static tensors; in the graph: every layer reads them
            lengths, tables = rings.prepare(live)
            attended.append([m.kernel(tables, lengths, new) for m in layers])
        else:  # exllamav3's forward: each layer's own host part, then its kernel
            seen = []
            for m in layers:
                table, lengths = m._decode_state_prep(live, m.k, m.v, 1)
                seen.append(m.kernel(table.tolist(), lengths.tolist(), new))
            attended.append(seen)
        for rs in live:  # advance_recurrent_states: position on, window_beg by the step's shift
            rs.position += 1
            rs.window_beg += rs.wshift
    rings_now = [(m.k.clone(), m.v.clone()) for m in layers]
    return attended, rings_now, [(rs.position, rs.window_beg) for rs in states], rings.shifts


def test_the_captured_ring_step_is_exllamav3s_own_step_by_step_across_page_shifts() -> None:
    want_seen, want_rings, want_states, _ = run_steps(captured=False)
    got_seen, got_rings, got_states, shifts = run_steps(captured=True)
    assert got_states == want_states
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got_rings, want_rings, strict=True))
    assert got_seen == want_seen
    # rows crossed their ring's end (768 tokens) on different steps, some several times
    assert shifts == sum((p - 1) // PAGE - 2 for p, _ in want_states if p > 768)
    assert shifts >= 8 and want_states[0][1] > 0
    # and what every row attended at every step is the window of its own last 128 tokens (the truth, not only agreement)
    for step, per_layer in enumerate(got_seen):
        live = [r for r in range(5) if step >= 131 * r]
        for keys in per_layer:
            for r, row_keys in zip(live, keys, strict=True):
                pos = step - 131 * r + 1
                assert row_keys == [float(r * 10_000 + p) for p in range(max(1, pos - 127), pos + 1)], (step, r)
