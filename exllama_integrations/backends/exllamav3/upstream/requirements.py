"""What the exllamav3 backend relies on in exllamav3 beside the fast path, by the module that relies on it.

:data:`NAMES` is every exllamav3 name the package imports (through :mod:`.`, the one place that imports them), with
the module that defines it; :data:`REQUIREMENTS` declares those names and what each backend module reads, writes,
calls by keyword or wraps on exllamav3's objects (the fast path's own: :mod:`..fast.requirements`). Both are checked
against exllamav3's source (:mod:`.depends`, no import) by ``python -m exllama_integrations.backends.exllamav3.fast``
and recorded per verified release in ``recorded/``. Unlike the fast path's, an unmet requirement here does not stand
anything aside at load: it names what a new release changed under :mod:`..patches`, :mod:`..extras` and the rest
before their GPU tests do (docs/exllamav3-releases.md).
"""

from __future__ import annotations

from .depends import Constant, Member, Mentions, Reads, Requirement

_X = "exllamav3"
_G, _J, _S = f"{_X}.generator.generator", f"{_X}.generator.job", f"{_X}.generator.sampler"
_M, _MOD, _A = f"{_X}.model.model", f"{_X}.modules", f"{_X}.architecture"

NAMES: dict[str, str] = {
    # the load chain (backend.py, extras.py, mtp.py, pooling.py, vision.py)
    "Cache": f"{_X}.cache.cache",
    "CacheLayer_quant": f"{_X}.cache.quant",
    "Config": f"{_X}.model.config",
    "Generator": _G,
    "Model": _M,
    "Tokenizer": f"{_X}.tokenizer.tokenizer",
    "LoRA": f"{_X}.model.lora",
    "get_architectures": f"{_A}.architectures",
    # requests as jobs (translate.py)
    "Job": _J,
    "Filter": f"{_X}.generator.filter.filter",
    "ComboSampler": f"{_S}.presets",
    **{n: f"{_S}.custom" for n in "CustomSampler SS SS_Base SS_LogitBias SS_RepP SS_Argmax SS_Temperature SS_MinP "
       "SS_TopK SS_TopP SS_Sample".split()},
    # upstream fixes (patches.py)
    "Gemma3Model": f"{_A}.gemma3",
    "_prepare_noncausal_mm_spans": f"{_A}.gemma4",
    "Qwen3_5Config": f"{_A}.qwen3_5",
    "Qwen3_5MoeConfig": f"{_A}.qwen3_5",
    "Qwen3_5MTPModel": f"{_A}.qwen3_5_mtp",
    "Qwen3_5MoeMTPModel": f"{_A}.qwen3_5_mtp",
    "GptOssModel": f"{_A}.gpt_oss",
    "BlockSparseMLP": f"{_MOD}.block_sparse_mlp",
    "LinearFP16": f"{_MOD}.quant.fp16",
    "LinearEXL3": f"{_MOD}.quant.exl3",  # (the pinned decode step: fast/seam/pins.py)
    # module kinds (patches.py, extras.py; the seam's model view)
    "Attention": f"{_MOD}.attn",
    "Embedding": f"{_MOD}.embedding",
    "GatedMLP": f"{_MOD}.mlp",
    "LayerNorm": f"{_MOD}.layernorm",
    "Linear": f"{_MOD}.linear",
    "MLP": f"{_MOD}.mlp",
    "RMSNorm": f"{_MOD}.rmsnorm",
    "TransformerBlock": f"{_MOD}.transformer",
    "SlicedMultiLinear": f"{_MOD}.multilinear",
    "get_for_device": f"{_X}.util.tensor",
    # recurrent layers in the captured step (the seam's model view)
    "GatedDeltaNet": f"{_MOD}.gated_delta_net",
    "Mamba2": f"{_MOD}.mamba2",
    "MAX_BSZ": f"{_MOD}.attention_fn.bc_attn",
    # MoE layers in the captured step (the seam's model view, fast/seam/moe.py)
    "MAX_BSZN": f"{_MOD}.block_sparse_mlp",
    "advance_recurrent_states": f"{_X}.cache.recurrent_util",
    # sliding-window rings in the captured step (fast/seam/rings.py)
    "SlidingAttention": f"{_MOD}.sliding_attn",
}  # fmt: skip
"""Every exllamav3 name the package imports -> the module that defines it (``from ..upstream import Model``)."""

MODULES = frozenset(
    {f"{_MOD}.attn", f"{_MOD}.attention_fn.triton_paged", f"{_MOD}.quant.exl3", f"{_MOD}.block_sparse_mlp",
     f"{_MOD}.sliding_attn"}
)  # fmt: skip
"""exllamav3 modules reached as modules, for a global of theirs (the seam turns attn's and sliding_attn's
``_bc_attn_enable`` off, and gives ``block_sparse_mlp`` a sync-free ``torch.bincount`` inside a capture; the pins wrap
``triton_paged.paged_attn_triton_decode`` and call the extension as ``exl3.ext``)."""

_LIN, _CUSTOM = f"{_MOD}.linear", f"{_S}.custom"

BY_USER: dict[str, list[Requirement]] = {
    "backend.py": [
        Member(_M, "Model", "from_config", ("config", "component")),
        Member(_M, "Model", "load_gen", keywords=("progressbar", "max_chunk_size", "use_per_device", "device")),
        Member(_M, "Model", "warmup", keywords=("cache", "max_chunk_size", "max_batch_size")),
        Member(_M, "Model", "unload"),
        Member(f"{_X}.model.config", "Config", "from_directory"),
        Member(f"{_X}.cache.cache", "Cache", "__init__", ("model", "max_num_tokens"), ("layer_type", "max_history")),
        Member(f"{_X}.cache.quant", "CacheLayer_quant", "__init__", keywords=("k_bits", "v_bits")),
        Member(f"{_X}.tokenizer.tokenizer", "Tokenizer", "from_config"),
        Member(_G, "Generator", "__init__", keywords=("max_batch_size", "max_chunk_size", "prefill_cooldown",
               "shared_chunk_size", "ngram_match_min", "num_draft_tokens", "cpu_cache_size", "disk_cache_dir",
               "draft_model", "draft_cache")),
        Member(_G, "Generator", "num_draft_tokens"),
        Member(_G, "Generator", "close"),
        Member(f"{_X}.model.lora", "LoRA", "name"),
    ],
    "driver.py": [
        *(Member(_G, "Generator", n) for n in ("enqueue", "cancel", "iterate")),
        *(Member(_J, "Job", n) for n in ("constrain_output_now", "set_filters", "forced_ids")),
    ],
    "translate.py": [
        Member(f"{_S}.presets", "ComboSampler", "__init__", keywords=("rep_p", "temperature", "min_p", "top_k",
               "top_p", "logit_bias")),
        Member(_CUSTOM, "CustomSampler", "__init__", ("steps",)),
        Constant(_CUSTOM, "SS"),
        *(Member(_CUSTOM, "SS", n) for n in ("INIT", "LOGITS")),
        *(Member(_CUSTOM, "SS_Base", n) for n in ("run", "reqs_past_ids")),
        *(Member(_CUSTOM, "SamplingState", n) for n in ("state", "logits", "in_logits", "past_ids")),
        Member(f"{_X}.generator.filter.filter", "Filter", "__init__", ("tokenizer", "trigger_token", "prefix_str",
               "eos_after_completed")),
        *(Member(f"{_X}.generator.filter.filter", "Filter", n) for n in ("reset", "accept_token",
          "get_next_logit_mask", "is_completed", "attach", "use_background_worker", "vocab_size")),
        Member(_J, "Job", "__init__", ("input_ids", "max_new_tokens"), ("sampler", "seed", "stop_conditions",
               "return_top_tokens", "return_probs", "filters", "decode_special_tokens", "embeddings")),
        *(Member(_J, "Job", n) for n in ("rq_cached", "cached_pages", "cached_tokens", "sequences")),
    ],
    "extras.py": [
        Member(f"{_X}.model.lora", "LoRA", "from_directory", ("model", "directory")),
        Member(f"{_X}.model.lora", "LoRA", "target_modules"),
        Member(_LIN, "Linear", "lora_a_tensors"),
        *(Member(f"{_MOD}.attn", "Attention", n) for n in "q_proj k_proj v_proj o_proj g_proj multi_kv multi_qg "
          "multi_qkv bc_attn bc_attn_step".split()),
        *(Member(f"{_MOD}.mlp", "MLP", n) for n in ("ups", "downs", "bc")),
        *(Member(f"{_MOD}.mlp", "GatedMLP", n) for n in ("gates", "ups", "downs", "bc", "multi_gu")),
    ],
    "mtp.py": [
        Member(f"{_X}.model.config", "Config", "model_classes"),
        Member(_M, "Model", "caps"),
    ],
    "mtp_parking.py": [
        *(Member(_G, "Generator", n) for n in ("draft_model", "mtp_draft", "num_draft_tokens", "iterate",
          "row_limited")),
        *(Member(_J, "Job", n) for n in ("accepted_draft_tokens", "rejected_draft_tokens", "mtp_last_hidden")),
        # what parking relies on, as many reads as 1.6.5 has (another read in a new release may be a new use of the
        # drafter the parked step would change): without a drafter a step drafts nothing and a prompt prefills as
        # without one; a drafted step drafts from each job's carry, which every attached target forward sets; the
        # last result carries the drafted counts only while the generator has a drafter
        Reads(_G, "Generator", "iterate", "self.draft_model", 2),
        Reads(_G, "Generator", "iterate", "self.mtp_draft", 2),
        Reads(_G, "Generator", "iterate_gen", "self.draft_model", 4),
        Reads(_G, "Generator", "iterate_gen", "self.mtp_draft", 1),
        Reads(_G, "Generator", "iterate_draftmodel_mtp_gen", "job.mtp_last_hidden", 2),
        Reads(_J, "Job", "prefill", "self.generator.draft_model", 7),
        Reads(_J, "Job", "prefill", "self.generator.mtp_draft", 4),
        Reads(_J, "Job", "receive_sample", "self.generator.draft_model", 1),
        Mentions(_J, "Job", "receive_sample", "accepted_draft_tokens"),
    ],
    "pooling.py": [
        Member(_M, "Model", "forward", ("input_ids", "params")),
        Member(_M, "Model", "modules"),
        Member(f"{_MOD}.module", "Module", "caps"),
        *(Mentions(f"{_MOD}.rmsnorm", "RMSNorm", "forward", k) for k in ("export_state_norm_keys", "export_states")),
        Mentions(f"{_MOD}.attn", "Attention", "forward", "flash_attn_nc"),
        Mentions(f"{_X}.model.model_ls", "Model_LSMixin", "forward_ls", "last_tokens_only"),
    ],
    "decisions.py": [
        Member(_M, "Model", "forward", ("input_ids", "params")),
        Member(_M, "Model", "caps"),
        *(Member(_G, "Generator", n) for n in ("model", "cache", "pagetable")),
        Member(f"{_X}.generator.pagetable", "PageTable", "allocate_pages", ("page_hashes", "new_unique_pages",
               "recurrent_pages")),
        Member(f"{_X}.generator.pagetable", "PageTable", "deallocate_pages", ("allocated_pages",)),
        Member(f"{_X}.generator.pagetable", "PageTable", "num_unreferenced_pages"),
        *(Member(f"{_X}.generator.pagetable", "CachePage", n) for n in ("page_index", "can_revert")),
        Member(f"{_X}.cache.cache", "Cache", "copy_page", ("target", "from_page", "to_page", "num_tokens")),
        *(Mentions(f"{_MOD}.attn", "Attention", "forward", k) for k in ("flash_attn", "flash_attn_nc")),
        Mentions(f"{_X}.model.model_ls", "Model_LSMixin", "forward_ls", "last_tokens_only"),
    ],
    "vision.py": [
        *(Member(f"{_A}.{m}", f"{c}VisionModel", "get_image_embeddings", keywords=("tokenizer", "image"))
          for m, c in (("gemma3", "Gemma3"), ("qwen2_5_vl", "Qwen2_5VL"), ("qwen3_vl", "Qwen3VL"),
                       ("mistral3", "Mistral3"))),  # the families vision.PLACEHOLDERS places
        Member(f"{_X}.tokenizer.mm_embedding", "MMEmbedding", "token_list_at"),
    ],
    "patches.py": [
        Member(_M, "Model", "__iter__"),
        Member(_M, "Model", "prepare_inputs", ("input_ids", "params")),
        *(Member(_LIN, "Linear", n) for n in "out_features out_features_unpadded trim_padded_out fkey fidx frange "
          "frange_dim finterleaved ftranspose_after_load transpose_fused_weights is_sliced device weight_scale "
          "in_features full_in_features full_out_features first_in_feature first_out_feature out_dtype inner "
          "quant_type".split()),
        Member(_LIN, "Linear", "load_fp16", ("key",)),
        Member(_LIN, "Linear", "pad_out", ("w",)),
        *(Member(f"{_MOD}.block_sparse_mlp", "BlockSparseMLP", n) for n in ("gates", "ups", "downs")),
        Member(f"{_MOD}.quant.fp16", "LinearFP16", "__init__", ("in_features", "out_features", "weight", "bias",
               "full_in_features", "full_out_features", "first_in_feature", "first_out_feature"), ("out_dtype", "key")),
        Member(f"{_X}.model.config", "Config", "stc"),
        *(Member(f"{_X}.loader.safetensors", "SafetensorsCollection", n) for n in ("has_tensor", "has_tensor_group")),
        Member(f"{_X}.loader.safetensors", "SafetensorsCollection", "get_tensor", keywords=("transpose", "no_defer",
               "fidx", "optional")),
        *(Member(f"{_A}.qwen3_5", c, "mtp_num_hidden_layers") for c in ("Qwen3_5VLBaseConfig",
          "Qwen3_5VLMoeBaseConfig")),  # the bases of Qwen3_5Config and Qwen3_5MoeConfig
        *(Member(f"{_MOD}.module", "Module", n) for n in ("key", "alt_key", "config")),
    ],
}  # fmt: skip
"""What each backend module relies on beyond importing :data:`NAMES`."""

REQUIREMENTS: list[Requirement] = [
    *(Constant(module, name) for name, module in NAMES.items()),
    *(r for reqs in BY_USER.values() for r in reqs),
]
"""The backend's requirements: every imported name, and what :data:`BY_USER` declares."""
