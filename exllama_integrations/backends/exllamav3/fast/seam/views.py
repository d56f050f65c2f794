"""The typed views through which the fast path reads exllamav3's jobs, pages, generator and model.

Part of the seam (:mod:`.`): these classes and :class:`~.Seam`'s wraps are the only code that reads exllamav3's
internals; the features see exllamav3 only through them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from .mamba import mamba_stands_aside, own_rows
from .moe import MoeLayer, moe_layer, sync_free_bincount
from .moe import why_eager as moe_why_eager
from .rings import Rings, rings_stand_aside

# ---------------------------------------------------------------------- views of jobs, pages and the generator


class JobView:
    """What the fast path reads of one exllamav3 ``Job`` (kept on the job: it goes when the job goes)."""

    __slots__ = ("job", "kept")

    def __init__(self, job: Any) -> None:
        self.job = job
        self.kept: Any = None  # what the fast path keeps for an adopted job

    @property
    def prefill_done(self) -> bool:
        return bool(self.job.is_prefill_done())

    @property
    def rows(self) -> int:
        """Sequences of the job (several with CFG): its rows in a step's logits."""
        return len(self.job.sequences)

    @property
    def new_tokens(self) -> int:
        return int(self.job.new_tokens)

    @property
    def forced(self) -> bool:
        """A forced token is pending (``constrain_output_now``) past token healing."""
        return self.job.forced_ids is not None and self.job.new_tokens >= 0

    @property
    def masked(self) -> bool:
        """A grammar or token mask applies at this step."""
        return self.job.device_logit_mask is not None

    @property
    def wants_probs(self) -> bool:
        return bool(self.job.return_probs or self.job.return_top_tokens)

    @property
    def returns_logits(self) -> bool:
        return bool(self.job.return_logits)

    @property
    def past_ids(self) -> Any:
        """The job's token ids so far on the device (prompt first), or None when exllamav3 did not prepare them."""
        return self.job.current_device_ids

    @property
    def pages(self) -> int:
        """Pages allocated to the job's first sequence."""
        return len(self.job.sequences[0].allocated_pages or ())

    def ends_with(self, token: int) -> bool:
        """Whether exllamav3's ``receive_sample`` will end or requeue the job on ``token``.

        A stop token, the token limit, the requeue budget; a stop string is not foreseen.
        """
        job = self.job
        n = job.new_tokens + 1
        rq = getattr(job, "max_rq_tokens", None)
        return token in job.stop_tokens or n >= job.max_new_tokens or (rq is not None and n > rq - job.rq_margin)


def view(job: Any) -> JobView:
    """The job's :class:`JobView` (made once, kept on the job)."""
    v = getattr(job, "fast_decode_view", None)
    if v is None:
        v = job.fast_decode_view = JobView(job)
    return v


class PageView:
    """What batched prefill reads of one cache page (a view: the page's current values)."""

    __slots__ = ("page",)

    def __init__(self, page: Any) -> None:
        self.page = page

    @property
    def ref_count(self) -> int:
        return int(self.page.ref_count)

    @property
    def kv_position(self) -> int:
        return int(self.page.kv_position)

    def tokens(self, n: int) -> Any:
        """The page's first ``n`` token ids (a copy)."""
        return self.page.sequence[0, :n].clone()


class GeneratorView:
    """What the features read of one exllamav3 ``Generator``."""

    def __init__(self, generator: Any) -> None:
        self.generator = generator

    @property
    def active(self) -> list[JobView]:
        return [view(j) for j in self.generator.active_jobs]

    @property
    def waiting(self) -> bool:
        """Jobs are waiting to start."""
        return bool(self.generator.pending_jobs)

    @property
    def max_chunk_size(self) -> int:
        return int(self.generator.max_chunk_size)

    @property
    def vocab_limit(self) -> int | None:
        return getattr(self.generator.tokenizer, "actual_vocab_size", None)

    @property
    def cache(self) -> Any:
        return self.generator.cache

    def pages_by_index(self) -> dict[int, PageView]:
        return {int(p.page_index): PageView(p) for p in self.generator.pagetable.all_pages}

    def prefill_stands_aside(self) -> str | None:
        """Why no prompt chunk of this generator can be held for batched prefill, or None when chunks can be."""
        gen = self.generator
        if getattr(gen, "draft_model", None) is not None:
            return "a draft model (its prefill follows the target's)"
        if getattr(gen, "recurrent_cache", None) is not None:
            return "a recurrent cache (checkpoints follow each chunk)"
        if getattr(gen.model, "loaded_tp", False):
            return "tensor parallelism"
        if getattr(gen, "cpu_page_cache", None) is not None or getattr(gen, "disk_page_cache", None):
            return "host page tiers"
        return None


# ---------------------------------------------------------------------- the model, for the captured step


class ModelView:
    """The model's decode forward split at the embedding, for capture (``Model.forward_ls`` from the first block)."""

    def __init__(self, model: Any, recurrent: bool = False) -> None:
        self.model = model
        self.capture_recurrent = recurrent
        self.embedding: Any = None
        self.layers: list[Any] = []
        self.device: Any = None
        self.recurrent: list[str] = []
        """The captured kinds of recurrent layer the model has (Gated DeltaNet, Mamba-2): their state lives in the
        cache's pools, addressed by per-row slot tensors that a captured step reads from static buffers."""
        self.mamba: list[Any] = []
        """The model's Mamba-2 layers (:mod:`.mamba`: captured as Gated DeltaNet's are)."""
        self.moe: list[MoeLayer] = []
        """The model's MoE layers (``BlockSparseMLP``): captured at the row counts their forward serves without a host
        sync (:mod:`.moe`); a step of other rows runs eagerly."""
        self.rings: Rings | None = None
        """The model's sliding-window rings (``SlidingAttention``, with ``recurrent``): their page tables and lengths
        static tensors the graph reads, their page shifts run before the replay (:mod:`.rings`)."""
        self.why_not = self._stands_aside()
        if self.why_not is None:
            mods = model.fwd_modules
            self.embedding, self.layers, self.device = mods[0][0], mods[1:], mods[1][0].device

    def release(self) -> None:
        """Drop every reference to the model (it is about to unload)."""
        self.model = self.embedding = self.device = self.rings = None
        self.layers, self.mamba = [], []
        self.why_not = self.why_not or "closed"

    def _stands_aside(self) -> str | None:
        try:
            from ...upstream import (
                MAX_BSZN,
                MLP,
                Attention,
                BlockSparseMLP,
                Embedding,
                GatedDeltaNet,
                GatedMLP,
                LayerNorm,
                Linear,
                Mamba2,
                RMSNorm,
                SlidingAttention,
                TransformerBlock,
            )
        except ImportError as e:
            return f"exllamav3's modules do not import ({e})"
        model = self.model
        if getattr(model, "loaded_tp", False):
            return "a tensor-parallel model"
        if list(model._get_prefetch_layers):
            return "a layer that prefetches per-token rows"
        if getattr(model.config, "moe_cpu_hosts", None):
            return "MoE experts on the CPU"
        mods = list(model.fwd_modules)
        if not mods or type(mods[0][0]) is not Embedding:
            return "the first module is not a token embedding"
        devices = set()
        rings: list[tuple[Any, int]] = []
        for module, instance, _ in mods[1:]:
            kind = type(module)
            if kind is TransformerBlock:
                if getattr(module, "attn_hc", None) or getattr(module, "mlp_hc", None):
                    return "hyper-connections"
                attn, mlp = module.attn, module.mlp
                # Gated DeltaNet proven on the GPU (2026-12-07); Mamba-2 keeps its state in the same pools (.mamba)
                if self.capture_recurrent and type(attn) is GatedDeltaNet and not getattr(attn, "kda", False):
                    self.recurrent.append(type(attn).__name__)
                elif self.capture_recurrent and type(attn) is Mamba2:
                    why = mamba_stands_aside(attn)
                    if why is not None:
                        return why
                    self.recurrent.append(type(attn).__name__)
                    self.mamba.append(attn)
                elif self.capture_recurrent and type(attn) is SlidingAttention:
                    rings.append((attn, instance))
                elif attn is not None and (
                    type(attn) is not Attention or getattr(attn, "qsa_indexer", None) is not None
                ):
                    return f"an attention layer of kind {type(attn).__name__}"
                if type(mlp) is BlockSparseMLP:
                    layer = moe_layer(mlp, MAX_BSZN)
                    if isinstance(layer, str):
                        return layer
                    self.moe.append(layer)
                elif mlp is not None and type(mlp) not in (MLP, GatedMLP):
                    return f"an MLP of kind {type(mlp).__name__}"
            elif kind not in (RMSNorm, LayerNorm, Linear):
                return f"a layer of kind {kind.__name__}"
            devices.add(str(module.device))
        if len(devices) != 1 or not next(iter(devices)).startswith("cuda"):
            return f"layers on {sorted(devices)} (one CUDA device only)"
        if rings:
            if self.recurrent:  # (no exllamav3 1.6.5 model has both: one recurrent state class a model)
                return "sliding-window rings beside recurrent layers"
            why = rings_stand_aside([m for m, _ in rings])
            if why is not None:
                return why
            self.rings = Rings(rings)
        return None

    @property
    def stateful(self) -> bool:
        """A step carries per-row state (``recurrent_states``) that the captured step reads and advances."""
        return bool(self.recurrent) or self.rings is not None

    def moe_stands_aside(self, rows: int) -> str | None:
        """Why a step of ``rows`` rows runs eagerly for the model's MoE layers (naming them), or None."""
        return moe_why_eager(self.moe, rows) if self.moe else None

    def has_own_graphs(self) -> bool:
        """Whether exllamav3 graphs this model's layers itself at small batches (EXL3 weights)."""
        from ...upstream import Linear

        return any(
            isinstance(m, Linear) and getattr(m, "quant_type", None) == "exl3" for m in _walk(self.model.modules)
        )

    def prepare_inputs(self, input_ids: Any, params: dict[str, Any]) -> Any:
        return self.model.prepare_inputs(input_ids, params)

    def own_recurrent_rows(self) -> int:
        """Up to how many rows exllamav3 runs a recurrent layer's decode step its own graphed way (0: no such layer).

        ``BC_GatedDeltaNetSplit`` and ``BC_Mamba2`` (EXL3 projections), up to ``bc_attn.MAX_BSZ`` rows: the first
        call of a shape runs eagerly and the next captures a graph of its own, which synchronizes the device (inside
        our capture that fails), and its kernels are not the torch path's. Above it exllamav3 takes the torch path,
        which our capture records kernel for kernel. A Mamba-2 model without ``BC_Mamba2`` (fp16 / bf16 weights) takes
        the torch path at every row count (:func:`.mamba.own_rows`).
        """
        if not self.recurrent:
            return 0
        from ...upstream import MAX_BSZ

        if len(self.mamba) == len(self.recurrent):  # (a model's recurrent layers are of one kind)
            return own_rows(self.mamba, int(MAX_BSZ))
        return int(MAX_BSZ)

    def slot_tensors(self, params: dict[str, Any]) -> tuple[Any, Any]:
        """The step's recurrent slot tensors on the layers' device (``prepare_for_recurrence`` set them).

        The cache slot of each row's conv state, and the pool row its scan writes.
        """
        from ...upstream import get_for_device

        return (
            get_for_device(params, "recurrent_slots", self.device),
            get_for_device(params, "recurrent_slots_scan", self.device),
        )

    def advance(self, input_ids: Any, params: dict[str, Any]) -> None:
        """What ``Model.forward`` does after the layers: each row's recurrent state one position further.

        (A ring's ``window_beg`` moves by its ``wshift``.)
        """
        from ...upstream import advance_recurrent_states

        advance_recurrent_states(input_ids, params, self.model)

    def tables(self, params: dict[str, Any]) -> tuple[Any, Any]:
        """The step's block table and cache lengths on the model's device (exllamav3's per-dict upload cache)."""
        from ...upstream import get_for_device

        return get_for_device(params, "block_table", self.device), get_for_device(params, "cache_seqlens", self.device)

    def embed(self, x: Any, params: dict[str, Any]) -> Any:
        params["layer_instance"] = self.model.fwd_modules[0][1]
        params["resid_defer"] = False
        x = self.embedding.prepare_for_device(x, params)
        return self.embedding.forward(x, params)

    def run_layers(self, x: Any, params: dict[str, Any]) -> Any:
        """``Model.forward_ls`` from the first block on (the same residual deferral between blocks)."""
        from ...upstream import TransformerBlock

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

    @contextmanager
    def own_graphs_off(self) -> Iterator[None]:
        """exllamav3's own per-layer graphs (attention blocks, the MLP's 1..8-row paths) stand aside meanwhile.

        Inside a capture of the whole step their launch sequences are recorded as eager kernels; a graph of theirs
        would nest in ours (and their first call synchronizes the device, which a capture forbids). The attention
        switch is a module global of exllamav3's: another model in the same process that steps during a capture (at
        load with ``warmup``, or a step of a new shape) takes exllamav3's eager attention for that step (our steps
        captured this way gave its graphed path's greedy tokens in every comparison run; a server runs each model in
        its own engine process). On a model with MoE layers their expert counts are taken without a host read
        meanwhile (:func:`.moe.sync_free_bincount`: the same counts).
        """
        from ...upstream import MLP, GatedMLP, module

        attn_module: Any = module("exllamav3.modules.attn")

        mlps = [m for m in _walk(self.model.modules) if type(m) in (MLP, GatedMLP) and getattr(m, "bc", None)]
        saved, attn_module._bc_attn_enable = attn_module._bc_attn_enable, False
        bcs = [(m, m.bc) for m in mlps]
        try:
            for m, _ in bcs:
                m.bc = None
            with sync_free_bincount() if self.moe else nullcontext():
                yield
        finally:
            attn_module._bc_attn_enable = saved
            for m, bc in bcs:
                m.bc = bc

    def sliced_qkv(self) -> list[Any]:
        """The model's sliced Q/K/V GEMMs (whose output-pointer table exllamav3 builds with a pageable copy)."""
        from ...upstream import SlicedMultiLinear

        return [
            mq
            for module in _walk(self.model.modules)
            if isinstance(mq := getattr(module, "multi_qkv", None), SlicedMultiLinear)
        ]


def qkv_pointers(mq: Any, outputs: list[Any]) -> tuple[int, ...]:
    """The output addresses a sliced Q/K/V GEMM writes, for ``outputs`` (``SlicedMultiLinear.c_ptrs``'s table)."""
    return tuple(
        outputs[t].data_ptr() + n0 * outputs[t].element_size()
        for t, n0 in zip(mq.slice_targets, mq.slice_offsets, strict=True)
    )


def _walk(modules: list[Any]) -> Iterator[Any]:
    for m in modules:
        yield m
        yield from _walk(list(getattr(m, "modules", []) or []))
