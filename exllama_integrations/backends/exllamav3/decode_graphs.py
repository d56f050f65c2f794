"""``decode="fast"``, part two: exllamav3's decode forward captured as one CUDA graph per batch shape.

exllamav3 (1.6.5) graphs the attention block and the MLP of each layer for up to 8 rows of EXL3 weights; past 8
rows, and for fp16/bf16 weights always, every layer runs eagerly: hundreds of small kernels launched one by one
from Python, so the GPU waits on the host for most of a step. Here the whole decode forward after the embedding
(every transformer block, the final norm, the LM head) is captured once per ``(rows, block-table width)`` and
replayed: the step's token embeddings, block table and cache lengths are copied into the graph's static inputs,
one ``replay()`` runs the layers, and the logits come back in the graph's static output. The kernels are
exllamav3's own (its Triton paged decode, its GEMMs, its fused norms and RoPE) with the same launch shapes as
its eager path, so the logits are the same. Nothing of exllamav3 is forked.

How a graph comes to be: the first step of a new shape runs exllamav3's eager forward (so kernels compile,
autotuners pick and lazy workspaces are allocated outside any capture), then that shape is captured (capture
records without running: the cache is not written twice); from the next step of that shape on it is replayed.
Rows are not padded: a padded row would write its K/V into a page another job may own.

Where it stands aside (the eager forward runs; :meth:`DecodeGraphs.report` says why and how often):

* the model, for its whole life: tensor-parallel, several devices, a layer that is not a plain transformer
  block (recurrent, MoE, hyper-connections, sparse attention indexers, per-layer embeddings), MRoPE;
* a step: more than one position per row (prefill, drafting, healing), image embeddings, draft-model
  parameters, any parameter the captured forward was not built with;
* up to 8 rows on EXL3 weights: exllamav3 replays its own per-layer graphs there, which would nest in ours;
* a shape whose capture failed (said once in the log; that shape stays eager).

The next step's forward is replayed ahead of its step where the fast path foresees its rows (:mod:`.run_ahead`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

from .run_ahead import Ahead, PinnedStaging, ahead_differs, ahead_stands_aside, page_size

logger = logging.getLogger(__name__)

STEP_PARAMS = frozenset(
    {
        "attn_mode",
        "block_table",
        "cache",
        "cache_seqlens",
        "recurrent_states",
        "indexed_embeddings",
        "positions",
        "position_ids",
        "recurrent_history",
        "pinned_staging",
        "dev_cache",
    }
)
"""The parameters of a plain decode step (``Generator.iterate_gen`` without a draft model, and what
``prepare_flash_attn`` adds in block-table mode); a step with any other (``inv_freq``, ``position``, a draft
model's) is left to the eager forward, since the captured graph was built without it."""

OWN_GRAPH_ROWS = 8
"""exllamav3's per-layer graphs (``MAX_BSZ`` in ``attention_fn/bc_attn.py``, ``MAX_BSZN`` in ``modules/mlp.py``)
cover up to this many rows of EXL3 weights."""

OWN_GRAPHS = "(exllamav3's own per-layer graphs)"

MAX_GRAPHS = 160
"""Shapes kept at most (rows x block-table widths); past it a new shape runs eagerly."""


def model_stands_aside(model: Any) -> str | None:
    """Why ``model``'s decode forward cannot be captured whole, or None when it can."""
    try:
        from exllamav3.modules.attn import Attention
        from exllamav3.modules.embedding import Embedding
        from exllamav3.modules.layernorm import LayerNorm
        from exllamav3.modules.linear import Linear
        from exllamav3.modules.mlp import MLP, GatedMLP
        from exllamav3.modules.rmsnorm import RMSNorm
        from exllamav3.modules.transformer import TransformerBlock
    except ImportError as e:
        return f"exllamav3's modules do not import ({e})"

    if getattr(model, "loaded_tp", False):
        return "a tensor-parallel model"
    caps = getattr(model, "caps", {}) or {}
    if "mrope" in caps:
        return "MRoPE positions"
    if list(model._get_prefetch_layers):
        return "a layer that prefetches per-token rows"
    if getattr(model.config, "moe_cpu_hosts", None):
        return "MoE experts on the CPU"
    mods = list(model.fwd_modules)
    if not mods or type(mods[0][0]) is not Embedding:
        return "the first module is not a token embedding"
    devices = set()
    for module, _, _ in mods[1:]:
        kind = type(module)
        if kind is TransformerBlock:
            if getattr(module, "attn_hc", None) or getattr(module, "mlp_hc", None):
                return "hyper-connections"
            attn, mlp = module.attn, module.mlp
            if attn is not None and (type(attn) is not Attention or getattr(attn, "qsa_indexer", None) is not None):
                return f"an attention layer of kind {type(attn).__name__}"
            if mlp is not None and type(mlp) not in (MLP, GatedMLP):
                return f"an MLP of kind {type(mlp).__name__}"
        elif kind not in (RMSNorm, LayerNorm, Linear):
            return f"a layer of kind {kind.__name__}"
        devices.add(str(module.device))
    if len(devices) != 1 or not next(iter(devices)).startswith("cuda"):
        return f"layers on {sorted(devices)} (one CUDA device only)"
    return None


def step_stands_aside(input_ids: Any, params: dict[str, Any], min_rows: int) -> str | None:
    """Why a forward of ``input_ids`` with ``params`` is not a capturable decode step, or None when it is."""
    if input_ids is None or input_ids.dim() != 2 or input_ids.shape[1] != 1:
        return "more than one position per row"
    if params.get("attn_mode") != "flash_attn" or "block_table" not in params:
        return "not a paged decode step"
    extra = set(params) - STEP_PARAMS
    if extra:
        return f"parameters {sorted(extra)}"
    if params.get("indexed_embeddings") or params.get("recurrent_states") or params.get("recurrent_history"):
        return "image embeddings or recurrent state"
    if params.get("positions") is not None or params.get("position_ids") is not None:
        return "explicit positions"
    if int(input_ids.shape[0]) < min_rows:
        return f"up to {min_rows - 1} rows {OWN_GRAPHS}"
    return None


_CAPTURE_STREAMS: dict[str, Any] = {}


def capture_stream(device: Any) -> Any:
    """The side stream graphs are captured on: one per device for the whole process.

    torch keeps a cuBLAS workspace (32 MiB on the H200) per stream for the life of the process, so a stream per
    model would leave one behind at every load and close.
    """
    import torch

    key = str(device)
    if key not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[key] = torch.cuda.Stream(device=device)
    return _CAPTURE_STREAMS[key]


def has_own_graphs(model: Any) -> bool:
    """Whether exllamav3 graphs this model's layers itself at small batches (EXL3 weights)."""
    from exllamav3.modules.linear import Linear

    return any(isinstance(m, Linear) and getattr(m, "quant_type", None) == "exl3" for m in _walk(model.modules))


def _walk(modules: list[Any]) -> Any:
    for m in modules:
        yield m
        yield from _walk(list(getattr(m, "modules", []) or []))


class _Shape:
    """One captured decode forward and its static inputs and output."""

    __slots__ = ("graph", "x", "block_table", "cache_seqlens", "out", "keep", "replays")

    def __init__(self) -> None:
        self.graph: Any = None
        self.x: Any = None
        self.block_table: Any = None
        self.cache_seqlens: Any = None
        self.out: Any = None
        self.keep: list[Any] = []  # host tables the graph's copies read at every replay
        self.replays = 0


class DecodeGraphs:
    """Captured decode forwards of one exllamav3 ``Model`` (see the module docstring)."""

    def __init__(self, model: Any, min_rows: int | None = None, ahead: bool = True) -> None:
        """Checks ``model`` once.

        ``min_rows``: the fewest rows captured (default: 9 on EXL3 weights, else 1); ``ahead``: :meth:`launch_ahead`
        runs (False: it declines, for comparison).
        """
        self.model = model
        self.ahead = ahead
        self.ahead_launched = 0
        self.ahead_used = 0
        self.ahead_missed: Counter[str] = Counter()
        self._ahead: Ahead | None = None  # the forward that ran ahead of the coming step
        self._last: tuple[tuple[int, int], _Shape, Any, Any] | None = None  # the last step: key, shape, host tables
        self._staging = PinnedStaging()
        self.why_not = model_stands_aside(model)
        self.shapes: dict[tuple[int, int], _Shape | None] = {}
        self.eager: Counter[str] = Counter()
        self.failed: dict[str, str] = {}
        self.replays = 0
        self.own_graphs_step = False  # the last forward was left to exllamav3's own per-layer graphs
        self.min_rows = min_rows if min_rows is not None else 1
        self._pool: Any = None
        self._stream: Any = None
        self._ptr_tables: dict[tuple[int, ...], tuple[Any, Any]] = {}
        self._capturing: list[Any] | None = None  # what the graph being captured must keep alive
        self._patched: list[Any] = []
        self.captured: list[str] = []
        if self.why_not is not None:
            logger.info("decode='fast': the decode forward runs eagerly: %s", self.why_not)
            return
        if min_rows is None and has_own_graphs(model):  # (only here: it imports exllamav3)
            self.min_rows = OWN_GRAPH_ROWS + 1
        mods = model.fwd_modules
        self.embedding = mods[0][0]
        self.layers = mods[1:]
        self.device = mods[1][0].device
        self._patch_pointer_tables()

    # ------------------------------------------------------------------ a step

    def why_eager(self, input_ids: Any, params: dict[str, Any]) -> str | None:
        """Why this forward runs eagerly, or None when a captured graph runs it."""
        if self.why_not is not None:
            return "the model"
        return step_stands_aside(input_ids, params, self.min_rows)

    def forward(self, eager: Any, input_ids: Any, params: dict[str, Any]) -> Any:
        """The logits of one decode step: a captured graph where one covers it, else ``eager(input_ids, params)``."""
        why = self.why_eager(input_ids, params)
        self.own_graphs_step = why is not None and why.endswith(OWN_GRAPHS)
        ahead, self._ahead, self._last = self._ahead, None, None
        if why is not None:
            self.eager[why] += 1
            if ahead is not None:
                self.ahead_missed["the step ran eagerly"] += 1
            return eager(input_ids, params)
        import torch
        from exllamav3.util.tensor import get_for_device

        with torch.inference_mode():
            if ahead is not None:
                why_not = ahead_differs(ahead, input_ids, params)
                if why_not is None:  # its logits are this step's: the same graph ran on the same inputs
                    self.ahead_used += 1
                    self._remember(ahead.key, ahead.shape, params)
                    return ahead.shape.out
                self.ahead_missed[why_not] += 1
            x = self.model.prepare_inputs(input_ids, params)
            block_table = get_for_device(params, "block_table", self.device)
            cache_seqlens = get_for_device(params, "cache_seqlens", self.device)
            key = (int(block_table.shape[0]), int(block_table.shape[1]))
            if key not in self.shapes:
                if len(self.shapes) >= MAX_GRAPHS:
                    self.eager["too many shapes"] += 1
                    return eager(input_ids, params)
                out = eager(input_ids, params)  # this step, by exllamav3's own forward; its shape is captured after
                self.shapes[key] = self._capture(key, x, params)
                return out
            shape = self.shapes[key]
            if shape is None:
                self.eager["its capture failed"] += 1
                return eager(input_ids, params)
            self._remember(key, shape, params)
            emb = self._embed(x, params)
            shape.x.copy_(emb, non_blocking=True)
            shape.block_table.copy_(block_table, non_blocking=True)
            shape.cache_seqlens.copy_(cache_seqlens, non_blocking=True)
            shape.graph.replay()
        shape.replays += 1
        self.replays += 1
        return shape.out

    # ------------------------------------------------------------------ running ahead

    def _remember(self, key: tuple[int, int], shape: _Shape, params: dict[str, Any]) -> None:
        """Keep this step's host tables (copies: exllamav3 stages the next step in the same buffers)."""
        bt, sl = params["block_table"], params["cache_seqlens"]
        if self.ahead and bt.device.type == "cpu" and sl.device.type == "cpu":
            self._last = (key, shape, bt.clone(), sl.clone())

    @property
    def can_launch(self) -> bool:
        """Whether :meth:`launch_ahead` has a step to run ahead of (on, and the last forward was a replayed one)."""
        return self.ahead and self._last is not None

    def launch_ahead(self, tokens: list[int], pages: list[int]) -> bool:
        """Replay the next step's forward now: the last step's rows, one position further, fed ``tokens``.

        ``tokens``: the token each row drew at the last step (its input at the next); ``pages``: how many pages
        each row has allocated (a row whose next position lies past them is not run ahead: its block table would
        name a page it does not own). Call it only after the last step's forward is complete (exllamav3's
        synchronize): its pinned staging is rewritten here. Returns whether it launched.
        """
        last, self._last = self._last, None
        if last is None or self.why_not is not None:
            return False
        key, shape, block_table, cache_seqlens = last
        nxt = cache_seqlens + 1  # each row's next position (where the next step writes its K/V)
        why = ahead_stands_aside(key, nxt.tolist(), tokens, pages, page_size())
        if why is not None:
            self.ahead_missed[f"not launched: {why}"] += 1
            return False
        rows = key[0]
        import torch

        with torch.inference_mode():
            ids = torch.tensor(tokens, dtype=torch.long).view(rows, 1)
            # (exllamav3's prepare_inputs hands the ids back as they are; without pinned_staging the embedding does
            # not touch exllamav3's own staging buffer, which its next step writes while this copy may be queued)
            emb = self._embed(ids, {})
            shape.x.copy_(self._staging.stage("x", emb), non_blocking=True)
            shape.block_table.copy_(self._staging.stage("block_table", block_table), non_blocking=True)
            shape.cache_seqlens.copy_(self._staging.stage("cache_seqlens", nxt), non_blocking=True)
            shape.graph.replay()
        shape.replays += 1
        self.replays += 1
        self.ahead_launched += 1
        self._ahead = Ahead(key, shape, ids, block_table, nxt)
        return True

    # ------------------------------------------------------------------ the forward, split at the embedding

    def _embed(self, x: Any, params: dict[str, Any]) -> Any:
        params["layer_instance"] = self.model.fwd_modules[0][1]
        params["resid_defer"] = False
        x = self.embedding.prepare_for_device(x, params)
        return self.embedding.forward(x, params)

    def _layers(self, x: Any, params: dict[str, Any]) -> Any:
        """``Model.forward_ls`` from the first block on (the same residual deferral between blocks)."""
        from exllamav3.modules.transformer import TransformerBlock

        mods = self.layers
        for i, (module, instance, _) in enumerate(mods):
            params["layer_instance"] = instance
            x = module.prepare_for_device(x, params)
            nxt: Any = mods[i + 1][0] if i + 1 < len(mods) else None
            params["resid_defer"] = (
                type(module) is TransformerBlock and type(nxt) is TransformerBlock and nxt.device == module.device
            )
            x = module.forward(x, params)
        params.pop("resid_defer", None)
        pending = params.pop("resid_pending", None)
        if pending is not None:
            x += pending
        return x

    def _capture(self, key: tuple[int, int], x: Any, params: dict[str, Any]) -> _Shape | None:
        import torch

        rows, width = key
        shape = _Shape()
        t0 = time.perf_counter()
        try:
            # the same ids again, for the embedding's shape and dtype (its pinned staging buffer takes equal bytes)
            emb = self._embed(x, dict(params))
            shape.x = torch.empty(emb.shape, dtype=emb.dtype, device=self.device)
            shape.block_table = torch.zeros((rows, width), dtype=torch.int32, device=self.device)
            shape.cache_seqlens = torch.zeros((rows,), dtype=torch.int32, device=self.device)
            static: dict[str, Any] = {
                "attn_mode": "flash_attn",
                "block_table": shape.block_table,
                "cache": params["cache"],
                "cache_seqlens": shape.cache_seqlens,
                "recurrent_states": None,
                "indexed_embeddings": [],
                "recurrent_history": False,
                "pinned_staging": True,
            }
            self.model.prepare_inputs(x, static)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
                self._stream = capture_stream(self.device)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            self._capturing = shape.keep
            try:
                with torch.cuda.graph(graph, pool=self._pool, stream=self._stream, capture_error_mode="relaxed"):
                    shape.out = self._layers(shape.x, static)
            finally:
                self._capturing = None
            shape.graph = graph
            shape.keep.append(static)
            self.captured.append(f"{rows} rows x {width} pages")
            logger.info(
                "decode='fast': captured the decode step of %d rows x %d pages in %.0f ms (%d shapes)",
                rows,
                width,
                (time.perf_counter() - t0) * 1000,
                len(self.captured),
            )
            return shape
        except Exception as e:  # noqa: BLE001 - that shape stays eager, said once
            why = f"{type(e).__name__}: {str(e)[:300]}"
            self.failed[f"{rows} rows x {width} pages"] = why
            logger.warning("decode='fast': capturing a decode step of %d rows failed (%s); it runs eagerly", rows, why)
            try:
                torch.cuda.synchronize(self.device)
            except Exception:  # noqa: BLE001 - a broken capture may leave an error on the stream
                logger.exception("decode='fast': synchronizing after a failed capture")
            return None

    # ------------------------------------------------------------------ exllamav3's pointer tables

    def _patch_pointer_tables(self) -> None:
        """Build the sliced Q/K/V GEMM's output-pointer table without a pageable copy, and keep it per address set.

        exllamav3 builds it with ``torch.tensor(ptrs, device=cuda)``: a pageable copy that syncs the stream (once
        per layer per step at 2-32 rows), and cannot be captured at all. Here the table is staged through pinned
        memory and copied without blocking; a table is kept per set of output addresses (the allocator hands the
        same addresses back from step to step, and a captured graph's never change), so a step usually builds
        none.
        """
        from exllamav3.modules.multilinear import SlicedMultiLinear

        for module in _walk(self.model.modules):
            mq = getattr(module, "multi_qkv", None)
            if isinstance(mq, SlicedMultiLinear) and "c_ptrs" not in vars(mq):
                mq.c_ptrs = self._pointer_table(mq)
                self._patched.append(mq)

    def _pointer_table(self, mq: Any) -> Any:
        tables = self._ptr_tables

        def c_ptrs(outputs: list[Any]) -> Any:
            import torch

            ptrs = tuple(
                outputs[t].data_ptr() + n0 * outputs[t].element_size()
                for t, n0 in zip(mq.slice_targets, mq.slice_offsets, strict=True)
            )
            hit = tables.get(ptrs)
            if hit is None:
                if len(tables) >= 4096:
                    tables.clear()
                host = torch.tensor(ptrs, dtype=torch.long).pin_memory()
                hit = tables[ptrs] = (host, host.to(mq.device, non_blocking=True))
            if self._capturing is not None:  # the graph reads this table (and copies the host one) at every replay
                self._capturing.append(hit)
            return hit[1]

        return c_ptrs

    def close(self) -> None:
        """Free every graph, its pool and the pointer tables, and give exllamav3 its own ``c_ptrs`` back.

        The model may outlive this (a runtime frees these before it unloads the model); the counts stay.
        """
        for shape in self.shapes.values():
            if shape is not None and shape.graph is not None:
                shape.graph.reset()
        self.shapes.clear()
        self._ptr_tables.clear()
        self._ahead = self._last = None
        self._staging.clear()
        for mq in self._patched:
            vars(mq).pop("c_ptrs", None)
        self._patched.clear()
        self._pool = self._stream = None
        self.model = self.embedding = None
        self.layers = []
        self.why_not = self.why_not or "closed"

    # ------------------------------------------------------------------ diagnostics

    def report(self) -> dict[str, Any]:
        """Which decode forwards ran as captured graphs and which eagerly (and why)."""
        if self.why_not is not None:
            return {"captured": False, "stands_aside": self.why_not}
        return {
            "captured": True,
            "min_rows": self.min_rows,
            "shapes": sorted(self.captured, key=lambda k: tuple(int(n) for n in k.split()[::3])),
            "replays": self.replays,
            "eager_forwards": dict(self.eager),
            "capture_failed": dict(self.failed),
            "run_ahead": {
                "on": self.ahead,
                "launched": self.ahead_launched,
                "used": self.ahead_used,
                "missed": dict(self.ahead_missed),
            },
        }
