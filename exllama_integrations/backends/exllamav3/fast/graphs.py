"""``decode="fast"``: exllamav3's whole decode forward captured as one CUDA graph per batch shape and replayed.

Left to itself, exllamav3 (1.6.5) replays per-layer graphs of up to 8 rows of EXL3 weights (one graph launch and
its pointer patches per layer, from Python) and runs everything else eagerly: hundreds of small kernels launched
one by one, so the GPU waits on the host for most of a step. Here the whole decode forward after the embedding
(every transformer block, the final norm, the LM head) is captured once per ``(rows, block-table width)`` and
replayed: the step's token embeddings, block table and cache lengths are copied into static inputs, one
``replay()`` runs the layers, and the logits come back in a static output. The kernels are exllamav3's own (its
Triton paged decode, its GEMMs, its fused norms and RoPE) with the launch shapes of its eager path; inside a capture
its own per-layer graphs stand aside (:meth:`.seam.ModelView.own_graphs_off`), so their launch sequences are
recorded in ours. Nothing of exllamav3 is forked; the model is reached through :mod:`.seam` only.

One static buffer set serves every graph: inputs and logits sized to the largest batch and sliced (a block table
per width). A shape is captured after one eager step of it (kernels compile, autotuners pick and lazy workspaces
are allocated outside any capture): at load, for every row count up to the generator's batch at the first width
(:meth:`DecodeGraphs.capture_at_load`, what ``warmup=True`` does), else on the first step of that shape. Rows are
never padded: a row's attention split and GEMM tile follow the row count, so a padded step would not give
exllamav3's own logits.

Where it stands aside (the eager forward runs; :meth:`DecodeGraphs.report` says why and how often):

* the model, for its whole life: tensor-parallel, several devices, a layer that is not a plain transformer
  block (KDA, hyper-connections, sparse attention indexers, per-layer embeddings; a Mamba-2 layer of one head;
  sliding-window rings of several sizes, or beside recurrent layers, or looking ahead), MoE experts on the CPU,
  across devices, hash-routed or not EXL3-quantized;
* on a model with MoE layers, a step of rows whose MoE forward reads the expert counts back on the host
  (``rows x top_k`` past the fused kernel's row capacity, :mod:`.seam.moe`): that step runs eagerly, the report says
  which layers and why. Up to 8 rows the fused decode kernels run (no sync); above, exllamav3's sort path, captured
  with its ``bincount`` taken without a host read (the same counts);
* a step: more than one position per row (prefill, drafting, healing), positions other than the cache lengths (an
  MRoPE model's image job; its text jobs' positions are their lengths, captured), image embeddings, a speculative
  pass over recurrent state, draft-model parameters, any parameter the captured forward was not built with (a drafting
  target's undrafted step is captured: the hidden state its drafter reads next, ``export_state_norm_keys``, is written
  by the graph into tensors of its own and handed back after the replay, as exllamav3's norm hands it back);
* on a model with Gated DeltaNet layers, or Mamba-2 layers with EXL3 projections (Nemotron-H, :mod:`.seam.mamba`),
  a step of up to ``bc_attn.MAX_BSZ`` (8) rows: exllamav3 runs those layers through graphs of its own there (their
  kernels differ from the torch path's, and their second call captures, which cannot nest in ours). Above it (and
  at every row count for Mamba-2 on fp16 / bf16 weights, which takes the torch path throughout) the whole step is
  captured, the layers' state pools addressed through static per-row slot tensors copied in each step, each row's
  state advanced after the replay as ``Model.forward`` does; such a step is never run ahead (it writes in place);
* on a model with sliding-window rings (``SlidingAttention``: gpt-oss, Gemma 4, MiMo-V2) nothing more, at every
  row count: each row's page table in its ring and its length there are static tensors the graph reads, copied in
  before each replay; a row's page shift (host-decided) runs before it by exllamav3's own ``_decode_state_prep``; the
  states advance after it as ``Model.forward`` does; never run ahead (why it is exact: :mod:`.seam.rings`). Plain
  ``Attention`` with a window over the paged cache (Gemma 2/3, Cohere2, OLMo3) was captured before (a kernel constant);
* a shape whose capture failed (said once in the log; that shape stays eager), past :data:`MAX_GRAPHS` shapes.

The next step's forward is replayed ahead of its step where the fast path foresees its rows (:mod:`.run_ahead`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from typing import Any

from .capturable import LEFT_TO_EXLLAMAV3, Shape, exported, step_stands_aside
from .run_ahead import Ahead, PinnedStaging, ahead_differs, ahead_stands_aside
from .seam import TABLE_PAD, ModelView, moe_report, page_size, qkv_pointers
from .static import Static

logger = logging.getLogger(__name__)

MAX_GRAPHS = 256
"""Shapes kept at most (rows x block-table widths); past it a new shape runs eagerly."""

LOAD_WIDTH = TABLE_PAD
"""The block-table width (pages) captured at load: exllamav3 pads a step's table to a multiple of 16 pages
(:data:`.step.TABLE_PAD`), so every step of jobs under 4,096 tokens has it."""


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


class DecodeGraphs:
    """Captured decode forwards of one exllamav3 ``Model`` (see the module docstring)."""

    def __init__(
        self, model: Any, max_rows: int = 64, min_rows: int = 1, ahead: bool = True, recurrent: bool = False
    ) -> None:
        """Checks ``model`` once.

        ``max_rows``: the largest batch (the static buffers' rows); ``min_rows``: the fewest rows captured (fewer run
        as exllamav3 runs them); ``ahead``: :meth:`launch_ahead` runs (False: it declines, for comparison);
        ``recurrent``: Gated DeltaNet and Mamba-2 layers are captured (False: such a model stands aside).
        """
        self.view = ModelView(model, recurrent)
        self.why_not = self.view.why_not
        self.ahead = ahead
        self.ahead_launched = 0
        self.ahead_used = 0
        self.ahead_missed: Counter[str] = Counter()
        self._ahead: Ahead | None = None  # the forward that ran ahead of the coming step
        self._last: tuple[tuple[int, int], Shape, Any, Any] | None = None  # the last step: key, shape, host tables
        self._staging = PinnedStaging()
        self.static = Static(max_rows)
        self.shapes: dict[tuple[tuple[int, int], tuple[str, ...]], Shape | None] = {}  # (rows, width), exports
        self.eager: Counter[str] = Counter()
        self.failed: dict[str, str] = {}
        self.replays = 0
        self.own_graphs_step = False  # the last forward was left to exllamav3 below min_rows
        # a recurrent layer's own graphed path runs below this (see ModelView.own_recurrent_rows): left to it
        self.min_rows = max(min_rows, self.view.own_recurrent_rows() + 1) if self.why_not is None else min_rows
        self._pool: Any = None
        self._stream: Any = None
        self._ptr_tables: dict[tuple[int, ...], tuple[Any, Any]] = {}
        self._capturing: list[Any] | None = None  # what the graph being captured must keep alive
        self.pinned: Any = None  # deterministic=True's launch pins (seam.pins.LaunchPins), applied to every capture
        self.captured: list[str] = []
        self.captured_at_load = 0
        if self.why_not is not None:
            logger.info("decode='fast': the decode forward runs eagerly: %s", self.why_not)

    # ------------------------------------------------------------------ a step

    def why_eager(self, input_ids: Any, params: dict[str, Any]) -> str | None:
        """Why this forward runs eagerly, or None when a captured graph runs it."""
        if self.why_not is not None:
            return "the model"
        if int(input_ids.shape[0]) > self.static.rows:
            return "more rows than the static buffers hold"
        why = step_stands_aside(input_ids, params, self.min_rows, self.view.stateful)
        if why is None and self.view.rings is not None and not params.get("recurrent_states"):
            return "a sliding-window step without its ring states"
        return why if why is not None else self.view.moe_stands_aside(int(input_ids.shape[0]))

    def forward(self, eager: Callable[[Any, dict[str, Any]], Any], input_ids: Any, params: dict[str, Any]) -> Any:
        """The logits of one decode step: a captured graph where one covers it, else ``eager(input_ids, params)``."""
        why = self.why_eager(input_ids, params)
        self.own_graphs_step = why is not None and why.endswith(LEFT_TO_EXLLAMAV3)
        ahead, self._ahead, self._last = self._ahead, None, None
        if why is not None:
            self.eager[why] += 1
            if ahead is not None:
                self.ahead_missed["the step ran eagerly"] += 1
            return eager(input_ids, params)
        import torch

        exports = exported(params)
        with torch.inference_mode():
            if ahead is not None:
                why_not = ahead_differs(ahead, input_ids, params)
                if why_not is None and ahead.shape.exports != exports:
                    why_not = "other hidden states exported"
                if why_not is None:  # its logits are this step's: the same graph ran on the same inputs
                    self.ahead_used += 1
                    self._remember(ahead.key, ahead.shape, params)
                    ahead.shape.hand_back(params)
                    return self.static.logits[: ahead.key[0]]
                self.ahead_missed[why_not] += 1
            x = self.view.prepare_inputs(input_ids, params)
            block_table, cache_seqlens = self.view.tables(params)
            key = (int(block_table.shape[0]), int(block_table.shape[1]))
            # a drafting target's step exporting its drafter's hidden state, and the same step with the drafter
            # parked (exporting nothing), are two graphs kept side by side: a runtime switches between them
            if (key, exports) not in self.shapes:
                if len(self.shapes) >= MAX_GRAPHS:
                    self.eager["too many shapes"] += 1
                    return eager(input_ids, params)
                out = eager(input_ids, params)  # this step, by exllamav3's own forward; its shape is captured after
                self.shapes[(key, exports)] = self._capture(key, x, params, out)
                return out
            shape = self.shapes[(key, exports)]
            if shape is None:
                self.eager["its capture failed"] += 1
                return eager(input_ids, params)
            self._remember(key, shape, params)
            rows, width = key
            st = self.static
            st.x[:rows].copy_(self.view.embed(x, params), non_blocking=True)
            st.block_tables[width][:rows].copy_(block_table, non_blocking=True)
            st.cache_seqlens[:rows].copy_(cache_seqlens, non_blocking=True)
            if self.view.stateful:
                slots, slots_scan = self.view.slot_tensors(params)
                st.slots[:rows].copy_(slots, non_blocking=True)
                st.slots_scan[:rows].copy_(slots_scan, non_blocking=True)
            if self.view.rings is not None:  # (after any page shift)
                self.view.rings.stage(params["recurrent_states"], st.ring_tables[:rows], st.ring_lengths[:rows])
            shape.graph.replay()
            shape.hand_back(params)
            if self.view.stateful:
                self.view.advance(input_ids, params)  # as Model.forward does after its layers
        shape.replays += 1
        self.replays += 1
        return self.static.logits[:rows]

    # ------------------------------------------------------------------ capture

    def capture_at_load(
        self, eager: Callable[[Any, dict[str, Any]], Any], cache: Any, rows: Iterable[int], progress: bool
    ) -> int:
        """Capture the decode step of each row count in ``rows`` at :data:`LOAD_WIDTH` pages now, before any job.

        Each is run once eagerly first (kernels compile, autotuners pick), on token 0 at position 0 of the cache's
        first page: nothing owns a page yet, and a job writes every position it reads. Returns how many were
        captured.
        """
        if self.why_not is not None or self.view.stateful:  # (a recurrent step needs states: captured when it runs)
            return 0
        import torch
        from tqdm.auto import tqdm

        todo = [r for r in rows if self.min_rows <= r <= self.static.rows and self.view.moe_stands_aside(r) is None]
        todo = [r for r in todo if ((r, LOAD_WIDTH), ()) not in self.shapes]
        t0 = time.perf_counter()
        for r in tqdm(todo, desc="capturing decode steps", unit="shape", disable=not progress):
            with torch.inference_mode():
                ids = torch.zeros((r, 1), dtype=torch.long)
                params = {
                    "attn_mode": "flash_attn",
                    "block_table": torch.zeros((r, LOAD_WIDTH), dtype=torch.int32),
                    "cache": cache,
                    "cache_seqlens": torch.zeros((r,), dtype=torch.int32),
                    "recurrent_states": None,
                    "indexed_embeddings": [],
                    "positions": None,
                    "recurrent_history": False,
                    "pinned_staging": True,
                }
                x = self.view.prepare_inputs(ids, dict(params))
                out = eager(ids, dict(params))
                self.shapes[((r, LOAD_WIDTH), ())] = self._capture((r, LOAD_WIDTH), x, params, out)
        done = sum(1 for r in todo if self.shapes.get(((r, LOAD_WIDTH), ())) is not None)
        self.captured_at_load += done
        logger.info("decode='fast': captured %d decode steps at load in %.1f s", done, time.perf_counter() - t0)
        return done

    def _capture(self, key: tuple[int, int], x: Any, params: dict[str, Any], out: Any) -> Shape | None:
        import torch

        rows, width = key
        shape = Shape(rows, width, exported(params))
        t0 = time.perf_counter()
        try:
            # the same ids again, for the embedding's shape and dtype (its pinned staging buffer takes equal bytes)
            emb = self.view.embed(x, dict(params))
            st = self.static
            rings = self.view.rings
            st.ensure(emb, out, width, self.view.device, rings.pages if rings is not None else 0)
            static: dict[str, Any] = {
                "attn_mode": "flash_attn",
                "block_table": st.block_tables[width][:rows],
                "cache": params["cache"],
                "cache_seqlens": st.cache_seqlens[:rows],
                "recurrent_states": None,
                "indexed_embeddings": [],
                "recurrent_history": False,
                "pinned_staging": True,
            }
            if self.view.stateful:  # the states of the step captured: the graph reads only their cache's pools
                static["recurrent_states"] = params["recurrent_states"]
            if shape.exports:  # the norms append their outputs to static["export_states"] inside the capture
                static["export_state_norm_keys"] = set(shape.exports)
            self.view.prepare_inputs(x, static)
            if self.view.stateful:  # (after prepare_inputs, which sets the step's own slot tensors)
                static["recurrent_slots"], static["recurrent_slots_scan"] = st.slots[:rows], st.slots_scan[:rows]
                slots, slots_scan = self.view.slot_tensors(params)
                st.slots[:rows].copy_(slots)
                st.slots_scan[:rows].copy_(slots_scan)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
                self._stream = capture_stream(self.view.device)
            torch.cuda.synchronize(self.view.device)
            graph = torch.cuda.CUDAGraph()
            self._capturing = shape.keep
            try:
                with ExitStack() as inside:
                    inside.enter_context(
                        self.pinned.applied() if self.pinned is not None else self.view.own_graphs_off()
                    )
                    if rings is not None:  # the ring layers read the static page tables and lengths
                        inside.enter_context(rings.read_static(st.ring_tables[:rows], st.ring_lengths[:rows]))
                    inside.enter_context(
                        torch.cuda.graph(graph, pool=self._pool, stream=self._stream, capture_error_mode="relaxed")
                    )
                    logits = self.view.run_layers(st.x[:rows], static)
                    st.logits[:rows].copy_(logits)
            finally:
                self._capturing = None
            shape.exported = static.pop("export_states", None) or []
            if len(shape.exported) != len(shape.exports):
                graph.reset()
                raise RuntimeError(f"the captured step exported {len(shape.exported)} of the norms {shape.exports}")
            shape.graph = graph
            shape.keep.append(static)
            self.captured.append(f"{rows} rows x {width} pages" + ("+exports" if shape.exports else ""))
            logger.debug(
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
            logger.debug("decode='fast': the failed capture", exc_info=True)
            try:
                torch.cuda.synchronize(self.view.device)
            except Exception:  # noqa: BLE001 - a broken capture may leave an error on the stream
                logger.exception("decode='fast': synchronizing after a failed capture")
            return None

    # ------------------------------------------------------------------ running ahead

    def _remember(self, key: tuple[int, int], shape: Shape, params: dict[str, Any]) -> None:
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
        if self.view.stateful:  # a step run ahead writes each row's recurrent state or ring in place: a miss keeps it
            self.ahead_missed["not launched: recurrent state"] += 1
            return False
        key, shape, block_table, cache_seqlens = last
        nxt = cache_seqlens + 1  # each row's next position (where the next step writes its K/V)
        why = ahead_stands_aside(key, nxt.tolist(), tokens, pages, page_size())
        if why is not None:
            self.ahead_missed[f"not launched: {why}"] += 1
            return False
        rows, width = key
        import torch

        with torch.inference_mode():
            ids = torch.tensor(tokens, dtype=torch.long).view(rows, 1)
            # (exllamav3's prepare_inputs hands the ids back as they are; without pinned_staging the embedding does
            # not touch exllamav3's own staging buffer, which its next step writes while this copy may be queued)
            emb = self.view.embed(ids, {})
            st = self.static
            st.x[:rows].copy_(self._staging.stage("x", emb), non_blocking=True)
            st.block_tables[width][:rows].copy_(self._staging.stage("block_table", block_table), non_blocking=True)
            st.cache_seqlens[:rows].copy_(self._staging.stage("cache_seqlens", nxt), non_blocking=True)
            shape.graph.replay()
        shape.replays += 1
        self.replays += 1
        self.ahead_launched += 1
        self._ahead = Ahead(key, shape, ids, block_table, nxt)
        return True

    # ------------------------------------------------------------------ exllamav3's pointer tables

    def pointer_table(self, mq: Any) -> Callable[[list[Any]], Any]:
        """A ``c_ptrs`` for one sliced Q/K/V GEMM (installed by :class:`.seam.Seam`).

        Its output-pointer table without a pageable copy, kept per set of output addresses.

        exllamav3 builds it with ``torch.tensor(ptrs, device=cuda)``: a pageable copy that syncs the stream (once
        per layer per step at 2-32 rows), and cannot be captured at all. Here the table is staged through pinned
        memory and copied without blocking; the allocator hands the same addresses back from step to step, and a
        captured graph's never change, so a step usually builds none.
        """
        tables = self._ptr_tables

        def c_ptrs(outputs: list[Any]) -> Any:
            import torch

            ptrs = qkv_pointers(mq, outputs)
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
        """Free every graph, its pool, the static buffers and the pointer tables (the counts stay).

        The model may outlive this (a runtime frees these before it unloads the model).
        """
        for shape in self.shapes.values():
            if shape is not None and shape.graph is not None:
                shape.graph.reset()
        self.shapes.clear()
        self._ptr_tables.clear()
        self._ahead = self._last = None
        self._staging.clear()
        self.static.clear()
        self._pool = self._stream = None
        if self.pinned is not None:
            self.pinned.release()
        self.view.release()
        self.why_not = self.why_not or "closed"

    # ------------------------------------------------------------------ diagnostics

    def report(self) -> dict[str, Any]:
        """Which decode forwards ran as captured graphs and which eagerly (and why)."""
        if self.why_not is not None:
            return {"captured": False, "stands_aside": self.why_not}
        return {
            "captured": True,
            "min_rows": self.min_rows,
            "recurrent_layers": dict(Counter(self.view.recurrent)),
            **({"moe": moe_report(self.view.moe, self.static.rows)} if self.view.moe else {}),
            **({"rings": self.view.rings.report()} if self.view.rings is not None else {}),
            "max_rows": self.static.rows,
            "shapes": sorted(self.captured, key=lambda k: tuple(int(n) for n in k.split()[::3])),
            "captured_at_load": self.captured_at_load,
            "replays": self.replays,
            "replayed_share": round(self.replays / max(1, self.replays + sum(self.eager.values())), 4),
            "eager_forwards": dict(self.eager),
            "capture_failed": dict(self.failed),
            "run_ahead": {
                "on": self.ahead,
                "launched": self.ahead_launched,
                "used": self.ahead_used,
                "missed": dict(self.ahead_missed),
            },
        }
