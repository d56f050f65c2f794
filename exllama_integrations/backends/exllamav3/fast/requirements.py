"""What the fast path relies on in exllamav3, and the rule for a release.

:data:`REQUIREMENTS` declares every member :mod:`.seam` reads or wraps, the parameters of the methods it wraps, and
the keys of the ``params`` dicts exllamav3 builds for the forwards it replaces; :func:`stands_aside` checks them
against the installed library's source (:mod:`..upstream.depends`, no import) before anything is wrapped (the rest of
the backend's requirements: :mod:`..upstream.requirements`). The fast path runs on a release in :data:`VERIFIED`
(compared by PEP 440 release number: exllamav3's own CUDA wheels carry local labels such as
``1.6.5+cu128.torch2.9.0``) whose installed source meets every requirement; on any other it stands aside with its
reason, and exllamav3's own loop runs. ``EXLLAMA_FAST_UNVERIFIED=1`` lets a release that meets every requirement run
unverified, for trying a new release (docs/exllamav3-releases.md).
"""

from __future__ import annotations

import logging
import os
from functools import lru_cache

from ..upstream.depends import (
    Bound,
    Calls,
    Constant,
    DictKeys,
    Function,
    Member,
    Mentions,
    Reads,
    Requirement,
    facts,
    installed_version,
    problems,
    release,
    source_root,
)

logger = logging.getLogger(__name__)

VERIFIED = frozenset({(1, 6, 5)})
"""Releases the fast path was proven on (greedy tokens identical to exllamav3's own loop at 1, 16 and 64 jobs on
EXL3 and fp16 models; sampled draws matched to its ComboSampler; the GPU suite), by release number."""

UNVERIFIED_ENV = "EXLLAMA_FAST_UNVERIFIED"

PAGE_SIZE = 256
"""Tokens per page of exllamav3's paged cache: the one source of it in this package (cache sizing, the captured
step's tables, batched prefill), checked against exllamav3's own ``constants.PAGE_SIZE`` (a requirement)."""

STEP_PARAMS = frozenset(
    {"attn_mode", "block_table", "cache", "cache_seqlens", "recurrent_states", "indexed_embeddings", "positions",
     "position_ids", "recurrent_history", "pinned_staging", "dev_cache"}
)  # fmt: skip
"""The parameters of a plain decode step (``Generator.iterate_gen`` without a draft model, and what
``_upload_arena`` adds); a step with any other (``inv_freq``, ``position``, a draft model's) runs eagerly, since the
captured graph was built without it."""

EXPORT_PARAMS = frozenset({"export_state_norm_keys"})
"""A decode step's parameters a captured step takes too: the norms whose output the step hands back in
``params["export_states"]`` (a drafting target's step, ``draft_verifier_params`` of an MTP head: the hidden state its
next draft reads). Captured with them, the graph writes those outputs into tensors of its own, handed back (copied)
after each replay."""

PREFILL_PARAMS = frozenset(
    {"attn_mode", "block_table", "cache", "cache_seqlens", "recurrent_states", "indexed_embeddings", "inv_freq",
     "mm_span_prefix"}
)  # fmt: skip
"""The parameters of a text chunk's ``Model.prefill`` as ``Job.prefill`` builds them."""

_G, _J, _M = "exllamav3.generator.generator", "exllamav3.generator.job", "exllamav3.model.model"
_P, _MOD = "exllamav3.generator.pagetable", "exllamav3.modules"
REQUIREMENTS: list[Requirement] = [
    # wrapped
    Member(_G, "Generator", "iterate"),
    Member(_G, "Generator", "iterate_gen", ("results", "draft_tokens")),
    Member(_G, "Generator", "__init__", ("model", "cache", "tokenizer")),
    Member(_M, "Model", "forward", ("input_ids", "params")),
    Member(_M, "Model", "prefill", ("input_ids", "params")),
    Member(_M, "Model", "prefetch_tokens", ("ids",)),
    Member("exllamav3.cache.cache", "Cache", "copy_page", ("target", "from_page", "to_page", "num_tokens")),
    Member(_J, "Job", "receive_logits", ("logits",)),
    Member(f"{_MOD}.multilinear", "SlicedMultiLinear", "c_ptrs", ("outputs",)),
    # wrapped per job with deterministic=True: prefill sees no page to copy a partial page from (the one read of
    # all_pages in Job.prefill), and a page completed while decoding keeps its private hash
    Member(_J, "Job", "prefill", ("results", "chunk_size")),
    Member(_J, "Job", "hash_completed_page", ("seq", "page_idx")),
    Reads(_J, "Job", "prefill", "self.pagetable.all_pages"),
    # deterministic=True's prefill in blocks of K pages (seam/prefix.py, chunk_plan.py): a job's cached pages limited
    # to whole blocks for the length of exllamav3's count and allocation of its pages (Sequence.allocate_pages reads
    # max_cached_pages twice, the count reads it and all_unique_hashes, the allocation protects all_unique_hashes),
    # a page found complete by its hash (get_live_page); the chunk sizes, set to one page on a recurrent model
    Member(_J, "Job", "current_new_pages_required", ()),
    Member(_J, "Job", "allocate_pages", ()),
    Member(_J, "Job", "all_unique_hashes"),
    Reads(_J, "Job", "current_new_pages_required", "s.max_cached_pages", 2),
    Reads(_J, "Job", "current_new_pages_required", "self.all_unique_hashes"),
    Reads(_J, "Job", "allocate_pages", "self.all_unique_hashes"),
    Reads(_P, "Sequence", "allocate_pages", "self.max_cached_pages", 2),
    *(Member(_P, "Sequence", n) for n in "page_hashes max_cached_pages sequence_ids".split()),
    Member(_P, "PageTable", "get_live_page", ("phash",)),
    DictKeys(_G, "Generator", "iterate_gen", "params", STEP_PARAMS - {"dev_cache", "position_ids"}),
    DictKeys(_J, "Job", "prefill", "params", PREFILL_PARAMS),
    # read
    *(Member(_G, "Generator", n) for n in "pending_jobs active_jobs max_chunk_size shared_chunk_size pagetable "
      "draft_model recurrent_cache cpu_page_cache disk_page_cache model cache tokenizer".split()),
    Member("exllamav3.tokenizer.tokenizer", "Tokenizer", "actual_vocab_size"),
    *(Member(_J, "Job", n) for n in "new_tokens stop_tokens max_new_tokens max_rq_tokens rq_margin sequences "
      "return_logits forced_ids device_logit_mask return_probs return_top_tokens current_device_ids "
      "is_prefill_done pagetable".split()),
    Member(_P, "Sequence", "allocated_pages"),
    *(Member(_P, "CachePage", n) for n in "page_index ref_count kv_position sequence phash prev_hash "
      "can_revert".split()),
    Member(_P, "PageTable", "all_pages"),
    *(Member(_M, "Model", n) for n in "fwd_modules modules caps _get_prefetch_layers prepare_inputs config".split()),
    Mentions("exllamav3.model.model_ls", "Model_LSMixin", "forward_ls", "moe_cpu_hosts"),  # set on the config later
    Member("exllamav3.model.model_tp", "Model_TPMixin", "loaded_tp"),
    *(Member(f"{_MOD}.module", "Module", n) for n in "prepare_for_device forward device modules".split()),
    *(Member(f"{_MOD}.transformer", "TransformerBlock", n) for n in "attn mlp attn_hc mlp_hc".split()),
    *(Member(f"{_MOD}.attn", "Attention", n) for n in "qsa_indexer multi_qkv".split()),
    Member(f"{_MOD}.linear", "Linear", "quant_type"),
    *(Member(f"{_MOD}.multilinear", "SlicedMultiLinear", n) for n in "slice_targets slice_offsets".split()),
    *(Member(f"{_MOD}.mlp", c, "bc") for c in ("MLP", "GatedMLP")),
    Constant(f"{_MOD}.attn", "_bc_attn_enable"),
    Constant("exllamav3.constants", "PAGE_SIZE", PAGE_SIZE),
    Constant("exllamav3.util.tensor", "get_for_device"),
    # recurrent layers in a captured step (Gated DeltaNet): their slot tensors, their own graphed rows
    Member(f"{_MOD}.gated_delta_net", "GatedDeltaNet", "forward", ("x", "params")),
    Member(f"{_MOD}.gated_delta_net", "GatedDeltaNet", "kda"),
    Constant(f"{_MOD}.attention_fn.bc_attn", "MAX_BSZ", 8),
    Constant("exllamav3.cache.recurrent_util", "advance_recurrent_states"),
    # Mamba-2 layers in a captured step (seam/mamba.py): the kind; what picks its decode path (its own graphed BC_Mamba2
    # up to bc_attn's MAX_BSZ rows where it has one, ssd_chunked's host read where seqlen >= num_v_heads; the forward's
    # body is fingerprinted, so a release that changes the choice shows in the check); the state it shares with Gated
    # DeltaNet (GDNLayerState's pools, the slot tensors, the slotted kernels)
    Member(f"{_MOD}.mamba2", "Mamba2", "forward", ("x", "params")),
    *(Member(f"{_MOD}.mamba2", "Mamba2", n) for n in "bc num_v_heads num_k_heads layer_state_cls tp_reduce "
      "has_split_cache".split()),
    Constant(f"{_MOD}.mamba2", "_BC_MAX_BSZ"),
    *(Mentions(f"{_MOD}.mamba2", "Mamba2", "forward", k) for k in ("recurrent_states", "recurrent_slots",
      "recurrent_slots_scan")),
    # MoE layers in a captured step (seam/moe.py): what decides the row counts their forward serves without a host
    # sync, and the module's torch global (bincount taken without a host read inside a capture); the forward's body
    # is fingerprinted, so a release that changes it shows in the check
    Member(f"{_MOD}.block_sparse_mlp", "BlockSparseMLP", "forward", ("x", "params", "out_dtype")),
    *(Member(f"{_MOD}.block_sparse_mlp", "BlockSparseMLP", n) for n in "routing_gate router_type bc is_quantized "
      "num_experts_per_tok fused_rows fused_mode_buffers bc_sh_exp routing_device tp_reduce".split()),
    *(Member(f"{_MOD}.block_sparse_mlp_cpu", "BlockSparseMLP_CPU", n) for n in ("cpu_offload", "cpu_split_first")),
    Member("exllamav3.model.config", "InferParams", "no_reconstruct"),
    Member("exllamav3.model.config", "Config", "infer_params"),
    Constant(f"{_MOD}.block_sparse_mlp", "MAX_BSZN", 8),
    Constant(f"{_MOD}.block_sparse_mlp", "torch"),
    # sliding-window rings in a captured step (seam/rings.py): the kind and what decides it is captured; the decode
    # path's host part (run on the shifting rows before a replay, replaced by the static tensors inside a capture;
    # both bodies fingerprinted), its own graphed path's switch (a global of its module), the per-row state it reads
    Member(f"{_MOD}.sliding_attn", "SlidingAttention", "decode_flash_attn", ("x", "bsz", "seqlen", "params")),
    Member(f"{_MOD}.sliding_attn", "SlidingAttention", "_decode_state_prep", ("rsg", "k_states", "v_states", "seqlen")),
    Reads(f"{_MOD}.sliding_attn", "SlidingAttention", "decode_flash_attn", "self._decode_state_prep"),  # the one read
    *(Member(f"{_MOD}.sliding_attn", "SlidingAttention", n) for n in "kv_state_size sliding_window window_right "
      "num_kv_heads layer_idx".split()),
    Constant(f"{_MOD}.sliding_attn", "_bc_attn_enable"),
    *(Member(f"{_MOD}.sliding_attn", "SWAState", n) for n in "slot position window_beg wshift cache "
      "post_advance".split()),
    Member(f"{_MOD}.sliding_attn", "SWALayerState", "get_state_tensors"),
    Member("exllamav3.cache.cache", "Cache", "get_recurrent_layer", ("layer_instance",)),
    # the measured draft window (draft_rule): set before each iterate(), which reads it when it drafts
    Member(_G, "Generator", "num_draft_tokens"),
    # a drafting target's step exports the final norm's output (EXPORT_PARAMS): appended to params["export_states"]
    # by the norm, read back by iterate_gen after the forward
    Mentions(f"{_MOD}.rmsnorm", "RMSNorm", "forward", "export_state_norm_keys"),
    Mentions(f"{_MOD}.rmsnorm", "RMSNorm", "forward", "export_states"),
    Mentions(_G, "Generator", "iterate_gen", "export_states"),
]  # fmt: skip
"""What the fast path reads and wraps, checked against the installed exllamav3 before it hooks anything."""


_TP, _Q = f"{_MOD}.attention_fn.triton_paged", f"{_MOD}.quant"
PINNED: list[Requirement] = [
    # the attention's split plan, passed by keyword to the module global the dispatcher's decode functions call
    Function(_TP, "paged_attn_triton_decode", ("q", "k", "k_cache", "block_table", "num_splits", "max_kv_len",
             "pre_appended_len")),
    Calls(_TP, "fn_triton_paged_attn_decode", "paged_attn_triton_decode"),
    Calls(_TP, "fn_triton_paged_attn_decode_qc", "paged_attn_triton_decode"),
    # the GEMMs: LinearEXL3.forward and LinearFP16.forward wrapped, the EXL3 one run by the extension's exl3_gemm
    Member(f"{_Q}.exl3", "LinearEXL3", "forward", ("x", "params", "out_dtype")),
    *(Member(f"{_Q}.exl3", "LinearEXL3", n) for n in "trellis suh svh mcg mul1 bias out_features "
      "default_out_dtype".split()),
    *(Mentions(f"{_Q}.exl3", "LinearEXL3", "forward", k) for k in ("ovr", "reconstruct")),
    Constant(f"{_Q}.exl3", "ext"),
    Bound("exl3_gemm", "quant/exl3_gemm.cuh", ("A", "B", "C", "suh", "A_had", "svh", "force_shape_idx", "mcg", "mul1",
          "force_num_sms")),
    Member(f"{_Q}.fp16", "LinearFP16", "forward", ("x", "params", "out_dtype")),
    # the fused bundles set aside; what stands the strategy aside (sliding windows, LoRA, other weights)
    *(Member(f"{_MOD}.attn", "Attention", n) for n in "multi_qkv multi_kv multi_qg sliding_window".split()),
    Member(f"{_MOD}.mlp", "GatedMLP", "multi_gu"),
    *(Member(f"{_MOD}.linear", "Linear", n) for n in ("quant_type", "lora_a_tensors")),
]  # fmt: skip
"""What the pinned strategy of ``deterministic=True`` relies on (:mod:`.seam.pins`): checked when it is chosen;
unmet, the rows of a step run apart instead (:func:`pinned_unmet`)."""


@lru_cache(maxsize=1)
def pinned_unmet() -> list[str]:
    """What of :data:`PINNED` the installed exllamav3's source does not meet (empty: all met; checked once)."""
    root = source_root("exllamav3")
    if root is None:
        return ["exllamav3's source is not found"]
    return problems(PINNED, facts(root, PINNED))


# ---------------------------------------------------------------------- the rule for a release


def release_stands_aside(version: str | None, met: list[str] | None, unverified_ok: bool = False) -> str | None:
    """Why the fast path cannot run on exllamav3 ``version`` whose source left ``met`` unmet, or None when it can.

    ``met``: the requirements the installed source does not meet (empty: all met; None: not readable).
    """
    if version is None:
        return "exllamav3 is not installed"
    rel = release(version)
    if rel is None:
        return f"exllamav3 reports the version {version!r}, which is not a PEP 440 version"
    if met is None:
        return f"exllamav3 {version}'s source could not be read to check what the fast path relies on"
    if met:
        return f"exllamav3 {version} lacks what the fast path relies on: " + "; ".join(met[:4])
    if rel not in VERIFIED and not unverified_ok:
        shown = ", ".join(".".join(map(str, r)) for r in sorted(VERIFIED))
        return (
            f"exllamav3 {version} is not a verified release (verified: {shown}); its own loop runs. To try it, set "
            f"{UNVERIFIED_ENV}=1 (docs/exllamav3-releases.md)"
        )
    return None


@lru_cache(maxsize=1)
def stands_aside() -> str | None:
    """Why the fast path cannot run with the installed exllamav3, or None when it can (checked once a process)."""
    version = installed_version("exllamav3")
    root = source_root("exllamav3") if version is not None else None
    unmet = problems(REQUIREMENTS, facts(root, REQUIREMENTS)) if root is not None else None
    why = release_stands_aside(version, unmet, os.environ.get(UNVERIFIED_ENV) == "1")
    rel = release(version) if version else None
    if why is None and rel not in VERIFIED:
        logger.warning("decode='fast' runs on exllamav3 %s, which is not verified (%s=1)", version, UNVERIFIED_ENV)
    return why
