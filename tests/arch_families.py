"""The families people run in December 2026, as random-weight models through transformers' own classes.

Qwen3.5 dense and MoE (Gated DeltaNet layers between attention layers, with the checkpoints' MTP head), Qwen3-Next,
Gemma 4 (text), GLM-4.5/4.6/4.7 (MoE, and the MLA "lite"), DeepSeek-V3.x and V4, MiniMax-M2, Nemotron-H (Mamba-2
hybrid) and Kimi Linear, each an ``arch_models.Arch`` with its family's chat template (tests/data/chat_templates)
and special tokens; GPT-OSS is ``arch_models.ARCHS["gpt_oss"]``. Build one with ``make_arch(ARCHS_2026[name], out)``.
"""

from __future__ import annotations

from arch_models import _CHATML_SPECIALS, _DENSE_TINY, QWEN3, Arch, template_file

# The families people run in December 2026. Tiny sizes run on the CPU; ``gpu`` sizes are the smallest exllamav3's
# kernels take (head_dim 64/128, widths multiples of 128), built here and carried to the GPU machine with their fp32
# oracle (tests/gpu/build_family_fixtures.py), since its transformers lacks some of these classes.
_LINEAR_TINY = {
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}
_LINEAR_GPU = {
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 1,
    "linear_num_value_heads": 2,
}
_HYBRID_TINY = {**_DENSE_TINY, **_LINEAR_TINY, "num_hidden_layers": 4}
_HYBRID_GPU = {
    "hidden_size": 256,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "full_attention_interval": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "max_position_embeddings": 4096,
    **_LINEAR_GPU,
}
_SMALL_GPU = {
    "hidden_size": 256,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 4096,
}
_QWEN_MOE = {
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
}
_QWEN_MOE_GPU = {
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "num_experts": 4,
    "num_experts_per_tok": 2,
}
_DS_MOE = {
    "moe_intermediate_size": 32,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
}
_DS_MOE_GPU = {**_DS_MOE, "moe_intermediate_size": 128}
_MLA = {
    "head_dim": 8,  # MLA's rotary part: qk_rope_head_dim
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
}
_MLA_GPU = {
    "head_dim": 64,
    "num_key_value_heads": 2,
    "q_lora_rank": 128,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64,
    "v_head_dim": 64,
}
_THINK = ("<think>", "</think>")
_GLM = ("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", *_THINK)
_DEEPSEEK = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", *_THINK)
_GEMMA4 = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<|turn>",
    "<turn|>",
    "<|think|>",
    "<|channel>",
    "<channel|>",
    "<|tool>",
    "<tool|>",
    "<|tool_call>",
    "<tool_call|>",
    "<|tool_response>",
    "<tool_response|>",
    '<|"|>',
)
_NEMOTRON = (
    "<SPECIAL_10>",
    "<SPECIAL_11>",
    "<SPECIAL_12>",
    *_THINK,
    "<TOOLCALL>",
    "</TOOLCALL>",
    "<AVAILABLE_TOOLS>",
    "</AVAILABLE_TOOLS>",
    "<TOOL_RESPONSE>",
    "</TOOL_RESPONSE>",
)
_KIMI = (
    "[BOS]",
    "[EOS]",
    "<|im_system|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_middle|>",
    "<|im_end|>",
    *_THINK,
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)
_KIMI_LAYERS = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
_KIMI_KDA = {"kda_layers": [1, 2, 3], "full_attn_layers": [4], "short_conv_kernel_size": 4}
"""Kimi Linear's 3:1 KDA to full attention, as its checkpoints write it (layers counted from 1)."""

ARCHS_2026: dict[str, Arch] = {
    "qwen3_5": Arch(
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        _HYBRID_TINY,
        _HYBRID_GPU,
        _CHATML_SPECIALS,
        "<|im_end|>",
        template_file("qwen3_5"),
        reasons=True,
        key_prefix="model.language_model.",
        mtp=True,
        extra={"mtp_num_hidden_layers": 1},
    ),
    "qwen3_5_moe": Arch(
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        {**_HYBRID_TINY, **_QWEN_MOE},
        {**_HYBRID_GPU, **_QWEN_MOE_GPU},
        _CHATML_SPECIALS,
        "<|im_end|>",
        template_file("qwen3_5"),
        reasons=True,
        key_prefix="model.language_model.",
        mtp=True,
        extra={"mtp_num_hidden_layers": 1},
    ),
    "qwen3_next": Arch(
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        {**_HYBRID_TINY, **_QWEN_MOE},
        {**_HYBRID_GPU, **_QWEN_MOE_GPU},
        _CHATML_SPECIALS,
        "<|im_end|>",
        QWEN3,
        reasons=True,
    ),
    "gemma4": Arch(
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        {
            **_DENSE_TINY,
            "global_head_dim": 16,
            "sliding_window": 64,
            "hidden_size_per_layer_input": 0,
            "layer_types": ["sliding_attention", "full_attention"],
        },
        {
            **_SMALL_GPU,
            "global_head_dim": 128,
            "sliding_window": 128,
            "hidden_size_per_layer_input": 0,
            "layer_types": ["sliding_attention", "full_attention"],
        },
        _GEMMA4,
        "<turn|>",
        template_file("gemma4"),
        bos="<bos>",
        reasons=True,
    ),
    "glm4_moe": Arch(
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        {**_DENSE_TINY, **_DS_MOE},
        {**_SMALL_GPU, **_DS_MOE_GPU},
        _GLM,
        "<|endoftext|>",
        template_file("glm45"),
        reasons=True,
    ),
    "glm4_moe_lite": Arch(
        "Glm4MoeLiteConfig",
        "Glm4MoeLiteForCausalLM",
        {**_DENSE_TINY, **_DS_MOE, **_MLA},
        {**_SMALL_GPU, **_DS_MOE_GPU, **_MLA_GPU},
        _GLM,
        "<|endoftext|>",
        template_file("glm45"),
        reasons=True,
    ),
    "deepseek_v3": Arch(
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {**_DENSE_TINY, **_DS_MOE, **_MLA},
        {**_SMALL_GPU, **_DS_MOE_GPU, **_MLA_GPU},
        _DEEPSEEK,
        "<｜end▁of▁sentence｜>",
        template_file("deepseek_v31"),
        bos="<｜begin▁of▁sentence｜>",
        reasons=True,
    ),
    "deepseek_v4": Arch(
        "DeepseekV4Config",
        "DeepseekV4ForCausalLM",
        {
            "hidden_size": 64,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "q_lora_rank": 32,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "o_groups": 2,
            "o_lora_rank": 32,
            "index_n_heads": 2,
            "index_head_dim": 16,
            "index_topk": 8,
            "sliding_window": 16,
            "hc_mult": 2,
            "max_position_embeddings": 2048,
        },
        {
            "hidden_size": 256,
            "moe_intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 128,
            "q_lora_rank": 128,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "o_groups": 2,
            "o_lora_rank": 128,
            "index_n_heads": 2,
            "index_head_dim": 64,
            "index_topk": 64,
            "sliding_window": 128,
            "hc_mult": 2,
            "max_position_embeddings": 4096,
        },
        (*_DEEPSEEK, "｜DSML｜"),
        "<｜end▁of▁sentence｜>",
        template_file("deepseek_v4"),
        bos="<｜begin▁of▁sentence｜>",
        reasons=True,
    ),
    "minimax_m2": Arch(
        "MiniMaxM2Config",
        "MiniMaxM2ForCausalLM",
        {**_DENSE_TINY, "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2},
        {**_SMALL_GPU, "intermediate_size": 128, "num_local_experts": 4, "num_experts_per_tok": 2},
        ("]~!b[", "]~b]", "[e~[", *_THINK, "<minimax:tool_call>", "</minimax:tool_call>"),
        "[e~[",
        template_file("minimax_m2"),
        reasons=True,
    ),
    "nemotron_h": Arch(
        "NemotronHConfig",
        "NemotronHForCausalLM",
        {k: v for k, v in _DENSE_TINY.items() if k != "num_hidden_layers"}
        | {
            "layers_block_type": ["mamba", "attention", "mamba", "moe"],
            "ssm_state_size": 16,
            "mamba_num_heads": 4,
            "mamba_head_dim": 16,
            "n_groups": 2,
            "chunk_size": 16,
            "n_routed_experts": 4,
            "moe_intermediate_size": 32,
            "moe_shared_expert_intermediate_size": 32,
            "num_experts_per_tok": 2,
        },
        {k: v for k, v in _SMALL_GPU.items() if k != "num_hidden_layers"}
        | {
            "layers_block_type": ["mamba", "attention", "mamba", "moe"],
            "ssm_state_size": 64,
            "mamba_num_heads": 8,
            "mamba_head_dim": 64,
            "n_groups": 2,
            "chunk_size": 64,
            "n_routed_experts": 4,
            "moe_intermediate_size": 128,
            "moe_shared_expert_intermediate_size": 128,
            "num_experts_per_tok": 2,
        },
        _NEMOTRON,
        "<SPECIAL_12>",
        template_file("nemotron_h"),
        reasons=True,
    ),
    "kimi_linear": Arch(
        "KimiLinearConfig",
        "KimiLinearForCausalLM",
        {
            **_DENSE_TINY,
            **_MLA,
            "q_lora_rank": None,
            "num_hidden_layers": 4,
            "moe_intermediate_size": 32,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "linear_head_dim": 16,
            "linear_num_heads": 4,
            "layer_types": _KIMI_LAYERS,
            "linear_attn_config": {**_KIMI_KDA, "head_dim": 16, "num_heads": 4},
        },
        {
            **_SMALL_GPU,
            **_MLA_GPU,
            "q_lora_rank": None,
            "num_hidden_layers": 2,
            "moe_intermediate_size": 128,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "linear_head_dim": 128,
            "linear_num_heads": 2,
            "layer_types": ["linear_attention", "full_attention"],
            "linear_attn_config": {
                "kda_layers": [1],
                "full_attn_layers": [2],
                "short_conv_kernel_size": 4,
                "head_dim": 128,
                "num_heads": 2,
            },
        },
        _KIMI,
        "<|im_end|>",
        template_file("kimi_linear"),
        bos="[BOS]",
    ),
}
"""The 2026 families (their own test modules and GPU scripts; ``ARCHS`` keeps the matrix the GPU suite builds)."""

__all__ = ["ARCHS_2026"]
