"""Random-weight models of the architectures people run, built through transformers' own config and model classes.

``make_arch(name, out)`` writes a model directory (``save_pretrained`` of ``<Arch>ForCausalLM.from_config``) with a
byte-level BPE tokenizer whose special tokens are that family's, and a chat template of that family's shape
(turn markers, generation prompt, thinking blocks where the family reasons, tools where it renders them). Tiny
sizes run in CI on the CPU backend; ``size="gpu"`` is a realistic width for the oracle tests on the H200.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3's shape: ChatML; tools in the system turn, calls in <tool_call>, results in <tool_response>; an earlier
# turn's thinking is dropped; enable_thinking=False closes an empty block in the generation prompt.
QWEN3 = (
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n"
    "{% endif %}# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\nFor each call, return "
    '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call><|im_end|>\n'
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}<|im_start|>user\n{{ m['content'] }}<|im_end|>\n"
    "{% elif m['role'] == 'assistant' %}<|im_start|>assistant\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>\n{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": "
    "{{ c['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
# DeepSeek-R1's shape: the generation prompt opens the thinking block.
R1 = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'].split('</think>')[-1] }}<｜end▁of▁sentence｜>"
    "{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}"
)
LLAMA3 = (
    "<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
GEMMA3 = (
    "<bos>{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else 'user' %}"
    "<start_of_turn>{{ role }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
MISTRAL = (
    "<s>{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}</s>"
    "{% else %}[INST] {{ m['content'] }} [/INST]{% endif %}{% endfor %}"
)
PHI3 = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
HARMONY = (
    "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


@dataclass(frozen=True)
class Arch:
    """One family: its transformers classes, config fields, specials, end-of-turn token, chat template."""

    config: str
    model: str
    tiny: dict[str, Any]
    gpu: dict[str, Any]
    specials: tuple[str, ...]
    eos: str
    template: str
    bos: str | None = None
    reasons: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    key_prefix: str | None = None
    """Where the checkpoint keeps the text model's weights, where it is not ``model.`` (Qwen3.5:
    ``model.language_model.``, which exllamav3 reads and transformers maps back)."""
    mtp: bool = False
    """Write the checkpoint's multi-token-prediction head too (``mtp.*``, as Qwen3.5 checkpoints carry it)."""


_DENSE_TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 2048,
}
_DENSE_GPU = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "max_position_embeddings": 4096,
}
_CHATML_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)

ARCHS: dict[str, Arch] = {
    "llama3": Arch(
        "LlamaConfig",
        "LlamaForCausalLM",
        _DENSE_TINY,
        _DENSE_GPU,
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        "<|eot_id|>",
        LLAMA3,
        bos="<|begin_of_text|>",
        extra={"rope_theta": 500000.0},
    ),
    "qwen3": Arch(
        "Qwen3Config", "Qwen3ForCausalLM", _DENSE_TINY, _DENSE_GPU, _CHATML_SPECIALS, "<|im_end|>", QWEN3, reasons=True
    ),
    "qwen3_moe": Arch(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            **_DENSE_TINY,
            "moe_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
        },
        {
            **_DENSE_GPU,
            "moe_intermediate_size": 512,
            "num_experts": 16,
            "num_experts_per_tok": 4,
            "norm_topk_prob": True,
        },
        _CHATML_SPECIALS,
        "<|im_end|>",
        QWEN3,
        reasons=True,
    ),
    "deepseek_r1_distill": Arch(
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {k: v for k, v in _DENSE_TINY.items() if k != "head_dim"},
        {k: v for k, v in _DENSE_GPU.items() if k != "head_dim"},
        ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"),
        "<｜end▁of▁sentence｜>",
        R1,
        bos="<｜begin▁of▁sentence｜>",
        reasons=True,
    ),
    "smollm3": Arch(
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        _DENSE_TINY,
        _DENSE_GPU,
        _CHATML_SPECIALS,
        "<|im_end|>",
        QWEN3,
        reasons=True,
    ),
    "gemma3": Arch(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {**_DENSE_TINY, "sliding_window": 64, "query_pre_attn_scalar": 16},
        {**_DENSE_GPU, "sliding_window": 512, "query_pre_attn_scalar": 128},
        ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"),
        "<end_of_turn>",
        GEMMA3,
        bos="<bos>",
    ),
    "mistral": Arch(
        "MistralConfig",
        "MistralForCausalLM",
        _DENSE_TINY,
        _DENSE_GPU,
        ("<unk>", "<s>", "</s>", "[INST]", "[/INST]"),
        "</s>",
        MISTRAL,
        bos="<s>",
    ),
    "phi3": Arch(
        "Phi3Config",
        "Phi3ForCausalLM",
        {k: v for k, v in _DENSE_TINY.items() if k != "head_dim"},
        {k: v for k, v in _DENSE_GPU.items() if k != "head_dim"},
        ("<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"),
        "<|end|>",
        PHI3,
    ),
    "gpt_oss": Arch(
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            **_DENSE_TINY,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 64,
            "layer_types": ["sliding_attention", "full_attention"],
        },
        {
            **_DENSE_GPU,
            "max_position_embeddings": 131072,  # as its checkpoints: YaRN factor 32 x 4096, which exllamav3 derives
            "intermediate_size": 1024,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "sliding_window": 128,
            "layer_types": ["sliding_attention", "full_attention"] * 4,
        },
        (
            "<|startoftext|>",
            "<|endoftext|>",
            "<|start|>",
            "<|end|>",
            "<|message|>",
            "<|channel|>",
            "<|return|>",
            "<|call|>",
        ),
        "<|return|>",
        HARMONY,
    ),
}


TEMPLATES = Path(__file__).parent / "data" / "chat_templates"


def template_file(name: str) -> str:
    """A family's chat template from tests/data/chat_templates (``EXLLAMA_TEST_TEMPLATES=DIR``: the published one)."""
    import os

    theirs = os.environ.get("EXLLAMA_TEST_TEMPLATES")
    path = Path(theirs) / f"{name}.jinja" if theirs else TEMPLATES / f"{name}.jinja"
    if not path.is_file():
        path = TEMPLATES / f"{name}.jinja"
    return path.read_text(encoding="utf-8")


def _tokenizer(out: Path, vocab: int, arch: Arch) -> dict[str, int]:
    """A byte-level BPE tokenizer.json of exactly ``vocab`` ids with the family's specials; their ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = list(alphabet)
    merges = []
    letters = "etaoinshrdlucmfwypvbgk "
    for a in letters:
        for b in letters:
            if len(tokens) >= vocab - len(arch.specials) - 8:
                break
            pa, pb = a.replace(" ", "Ġ"), b.replace(" ", "Ġ")
            if pa + pb not in tokens:
                tokens.append(pa + pb)
                merges.append((pa, pb))
    i = 0
    while len(tokens) < vocab - len(arch.specials):
        tokens.append(f"x{i}")
        i += 1
    tok = Tokenizer(models.BPE(vocab={t: n for n, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # <think> and friends are added tokens but not special (they show in decoded text, as in Qwen3)
    plain = {"<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"}
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in arch.specials if t in plain])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in arch.specials if t not in plain])
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in arch.specials}
    assert tok.get_vocab_size() == vocab, tok.get_vocab_size()
    config = {
        "eos_token": arch.eos,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": arch.template,
        "add_bos_token": False,
    }
    if arch.bos:
        config["bos_token"] = arch.bos
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    gen = {"eos_token_id": ids[arch.eos]}
    if arch.bos:
        gen["bos_token_id"] = ids[arch.bos]
    (out / "generation_config.json").write_text(json.dumps(gen))
    return ids


def make_arch(
    name: str | Arch, out: Path, size: str = "tiny", seed: int = 0, device: str = "cpu", vocab: int | None = None
) -> Path:
    """Write a random-weight ``name`` model (or the given ``Arch``) to ``out`` through transformers' own classes."""
    import torch
    import transformers

    arch = ARCHS[name] if isinstance(name, str) else name
    vocab = vocab or (512 if size == "tiny" else 32000)
    out.mkdir(parents=True, exist_ok=True)
    ids = _tokenizer(out, vocab, arch)
    values = {**(arch.tiny if size == "tiny" else arch.gpu), **arch.extra, "vocab_size": vocab}
    values["eos_token_id"] = ids[arch.eos]
    values["bos_token_id"] = ids[arch.bos] if arch.bos else None
    values["pad_token_id"] = ids.get("<pad>", ids[arch.eos])
    values["tie_word_embeddings"] = False
    config = getattr(transformers, arch.config)(**values)
    torch.manual_seed(seed)
    dtype = torch.float32 if size == "tiny" else torch.bfloat16
    with torch.device(device):
        model = getattr(transformers, arch.model)(config).to(dtype)
    model.eval()
    model.save_pretrained(str(out), safe_serialization=True)
    if arch.key_prefix or arch.mtp:
        from arch_heads import rewrite_checkpoint

        rewrite_checkpoint(out, model, arch.key_prefix, arch.mtp, dtype, seed)
    del model
    return out


__all__ = ["ARCHS", "make_arch"]
