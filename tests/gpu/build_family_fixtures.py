"""Build the 2026 families' GPU fixtures HERE (transformers 5.24, CPU) with their fp32 oracle, to carry to the GPU.

The GPU machine has transformers 5.17, which lacks several of these classes, and no network: each family is built
by transformers' own classes at the smallest width exllamav3's kernels take (``arch_families.ARCHS_2026[...].gpu``:
hidden 256, head_dim 64/128, widths multiples of 128; vocabulary 1024; bf16 weights), and its oracle is computed here
in fp32 from those same bf16 weights. ``tests/gpu/family_matrix.py`` reads the folder on the GPU.

Each family's folder holds the model directory and ``oracle.json`` + ``oracle.safetensors``:

* the chat prompt's ids, the oracle's greedy tokens for ``--steps`` steps, and the fp32 logits at the prefill's last
  position and at each decode step (teacher-forced on those tokens: ``ref`` rows, as tests/gpu/test_gpu_models.py);
* a two-turn conversation whose first turn shares a long system prompt (past exllamav3's 2048-token recurrent-state
  checkpoint interval) with the second: both turns' ids and the oracle's cold-run tokens of the second turn;
* ``overlay``: the config keys written for exllamav3 where transformers 5 saves a field under another name or shape
  than the family's real checkpoints (each with why), checked to leave transformers' own model unchanged.

    python tests/gpu/build_family_fixtures.py --out DIR [--families qwen3_5,gemma4] [--steps 16]

Prints each family's size; the whole folder must stay well under the 40 MiB one call carries.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arch_families import ARCHS_2026  # noqa: E402
from arch_models import ARCHS, Arch, make_arch  # noqa: E402

log = logging.getLogger("build_family_fixtures")
VOCAB = 512
STEPS = 16
SYSTEM = "You answer questions about the sea, its tides, its fish and its ships, briefly and kindly. " * 34
"""The two-turn conversation's shared system prompt: about 2,300 tokens here, past exllamav3's recurrent-state
checkpoint interval (2048), so a second turn can start from a kept state."""
GPT_OSS_SMALL = {
    "hidden_size": 256,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 131072,  # as GPT-OSS checkpoints: 32 x YaRN's original 4096 (see GPT_OSS_WHY)
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"],
}
FAMILIES: dict[str, Arch] = {**ARCHS_2026, "gpt_oss": replace(ARCHS["gpt_oss"], gpu=GPT_OSS_SMALL)}
"""The 2026 families and GPT-OSS (built by transformers 5.24 here, as its oracle, at the carried width)."""
GPT_OSS_WHY = (
    "GPT-OSS checkpoints carry max_position_embeddings 131072 with YaRN factor 32 over 4096 (exllamav3 takes the "
    "factor as their ratio, transformers 5 from 'factor': with 4096 they disagree), and nonzero biases (transformers "
    "initialises every bias to zero, so a loader that drops them would pass unseen)"
)
BIAS_STD = 0.1
"""The spread of the GPT-OSS fixture's biases (q/k/v/o and both expert biases): enough that dropping one moves the
logits past the oracle's tolerance (measured on the CPU: tests/unit/test_exllamav3_patches.py)."""


def gpt_oss_biases(out: Path, seed: int) -> int:
    """Give the GPT-OSS fixture's biases seeded values, as its checkpoints have (transformers zeroes them); how many."""
    import torch
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    tensors = load_file(str(path))
    gen = torch.Generator().manual_seed(seed)
    names = sorted(k for k, v in tensors.items() if k.endswith("bias") and "router" not in k and not v.any())
    for k in names:
        v = tensors[k]
        tensors[k] = (torch.randn(v.shape, generator=gen) * BIAS_STD).to(v.dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return len(names)


def exllamav3_overlay(name: str, config: dict[str, Any]) -> dict[str, tuple[Any, str]]:
    """Keys to write into config.json for exllamav3 1.6.5, each with why (the family's real checkpoints carry them)."""
    out: dict[str, tuple[Any, str]] = {}
    if name == "nemotron_h":
        names = {"linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp", "moe": "moe"}
        why = "transformers 5 writes its own layer names; checkpoints (and exllamav3) use mamba/attention/mlp/moe"
        for key in ("layers_block_type", "mtp_layers_block_type"):
            if isinstance(config.get(key), list):
                out[key] = ([names.get(t, t) for t in config[key]], why)
    if name == "kimi_linear" and "first_k_dense_replace" not in config:
        dense = config.get("mlp_layer_types") or []
        first = next((i for i, t in enumerate(dense) if t != "dense"), len(dense))
        out["first_k_dense_replace"] = (first, "exllamav3 reads the dense layers as first_k_dense_replace (default 0)")
    if name == "deepseek_v4":
        rates = config.get("compress_rates") or {}
        ratio = {"sliding_attention": 0, **{k: int(v) for k, v in rates.items()}}
        why = "DeepSeek's checkpoint keys (compress_ratios per layer, num_hash_layers), which exllamav3 reads"
        out["compress_ratios"] = ([ratio[t] for t in config["layer_types"]], why)
        out["compress_rate_csa"] = (ratio.get("compressed_sparse_attention", 4), why)
        out["compress_rate_hca"] = (ratio.get("heavily_compressed_attention", 128), why)
        mlp = config.get("mlp_layer_types") or []
        out["num_hash_layers"] = (sum(1 for t in mlp if t == "hash_moe"), why)
        out["qk_rope_head_dim"] = (int(config["head_dim"] * (config.get("partial_rotary_factor") or 0)), why)
    return out


DEEPSEEK_V4_ROOT = {
    "embed_tokens.weight": "embed.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}
"""DeepSeek-V4's checkpoint keys sit at the root (``embed.weight``, ``layers.N...``, ``hc_head_fn``): what exllamav3
reads and transformers maps from. transformers 5.24 saves them back under ``model.`` and leaves its root renames undone
(``model.embed_tokens.weight``), a layout no checkpoint has and exllamav3 does not find."""


KIMI_DENSE = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.((?:gate|up|down)_proj\.weight)$")
"""Kimi Linear's dense layers keep their MLP as ``mlp.*`` (exllamav3 reads it there); transformers 5.24 saves every
layer's as ``block_sparse_moe.*`` (the reverse of its load-time rename, which maps both)."""
DEEPSEEK_V4_KV_NORM = re.compile(r"^(layers\.\d+\.attn)\.norm\.weight$")
"""DeepSeek-V4's attention norm is ``attn.kv_norm`` (its compressor's is ``compressor.norm``); transformers 5.24 saves
both as ``norm`` (its load-time rename maps ``.norm.`` to ``.kv_norm.``, and back without telling them apart)."""


def checkpoint_keys(name: str, out: Path) -> int:
    """Rewrite the saved keys as the family's checkpoints have them, where transformers saves others; how many."""
    if name not in ("deepseek_v4", "kimi_linear"):
        return 0
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    tensors = load_file(str(path))
    renamed = {}
    for k, v in tensors.items():
        new = k
        if name == "deepseek_v4":
            root = k[len("model.") :] if k.startswith("model.") else k
            new = DEEPSEEK_V4_KV_NORM.sub(r"\1.kv_norm.weight", DEEPSEEK_V4_ROOT.get(root, root))
        elif name == "kimi_linear":
            new = KIMI_DENSE.sub(r"\1.mlp.\2", k)
        renamed[new] = v
    save_file(renamed, str(path), metadata={"format": "pt"})
    return sum(1 for a, b in zip(tensors, renamed) if a != b)


def gemma4_checkpoint_text_config(text: dict[str, Any]) -> dict[str, Any]:
    """Gemma 4's ``text_config`` as Google's checkpoints write it: the full-attention layers' head size and KV heads as
    ``global_head_dim`` / ``num_global_key_value_heads`` (what exllamav3 reads), not transformers 5.24's
    ``per_layer_config`` (which its ``Gemma4TextConfig`` derives from those two keys again on load)."""
    from exllama_integrations.backends.exllamav3.patches import gemma4_global_attention

    keys = gemma4_global_attention({"model_type": "gemma4", "text_config": text})
    if not keys:
        raise RuntimeError(f"gemma4: per_layer_config {text.get('per_layer_config')!r} is not one global override")
    return {k: v for k, v in keys["text_config"].items() if k != "per_layer_config"}


def _gemma4_conditional(arch: Arch, out: Path, seed: int) -> Path:
    """Gemma 4 as its checkpoints are (``Gemma4ForConditionalGeneration``: exllamav3's architecture for it), with a
    tiny vision tower and the processor_config.json exllamav3 reads; the text model is the family's ``gpu`` size."""
    import torch
    import transformers

    text = make_arch(arch, out / "_text", size="gpu", seed=seed, vocab=VOCAB)
    text_config = json.loads((text / "config.json").read_text())
    vision = {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "patch_size": 16,
        "pooling_kernel_size": 3,
        "position_embedding_size": 1024,
    }
    ids = {
        k: VOCAB - 1 - i
        for i, k in enumerate(
            ("image_token_id", "boi_token_id", "eoi_token_id", "video_token_id", "audio_token_id", "boa_token_id")
        )
    }
    config = transformers.Gemma4Config(
        text_config=text_config, vision_config=vision, audio_config=None, tie_word_embeddings=False, **ids
    )
    torch.manual_seed(seed)
    model = transformers.Gemma4ForConditionalGeneration(config).to(torch.bfloat16).eval()
    model.save_pretrained(str(out), safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(text / f, out / f)
    shutil.rmtree(text)
    saved = json.loads((out / "config.json").read_text())
    saved["vision_soft_tokens_per_image"] = 16
    saved["text_config"] = gemma4_checkpoint_text_config(saved["text_config"])
    (out / "config.json").write_text(json.dumps(saved, indent=1))
    processor = {
        "image_processor": {
            "do_convert_rgb": True,
            "do_rescale": True,
            "do_normalize": False,
            "image_mean": [0.0, 0.0, 0.0],
            "image_std": [1.0, 1.0, 1.0],
            "resample": 3,
            "rescale_factor": 1 / 255,
            "max_soft_tokens": 16,
            "patch_size": 16,
            "pooling_kernel_size": 3,
        }
    }
    (out / "processor_config.json").write_text(json.dumps(processor, indent=1))
    return out


def build(name: str, out: Path, seed: int, steps: int) -> dict[str, Any]:
    """One family's model directory and oracle in ``out``; what ``oracle.json`` says."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from exllama_integrations import ExLlamaRuntime

    arch = FAMILIES[name]
    if out.exists():
        shutil.rmtree(out)
    t0 = time.perf_counter()
    if name == "gemma4":
        _gemma4_conditional(arch, out, seed)
    else:
        make_arch(arch, out, size="gpu", seed=seed, vocab=VOCAB)
    renamed = checkpoint_keys(name, out)
    biases = gpt_oss_biases(out, seed) if name == "gpt_oss" else 0
    config = json.loads((out / "config.json").read_text())
    overlay = exllamav3_overlay(name, config)
    if overlay:
        (out / "config.json").write_text(json.dumps({**config, **{k: v for k, (v, _) in overlay.items()}}, indent=1))

    rt = ExLlamaRuntime(out, "transformers")  # the prompts as the package renders and encodes them
    try:
        prompt = rt.encode(rt.chat_prompt([{"role": "user", "content": "Tell me about the sea."}]))
        turn1_messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Is it deep?"}]
        turn1 = rt.encode(rt.chat_prompt(turn1_messages))
    finally:
        rt.close()
    auto: Any = AutoModelForCausalLM
    if "vision_config" in config:
        from transformers import AutoModelForImageTextToText

        auto = AutoModelForImageTextToText
    model, info = auto.from_pretrained(str(out), dtype=torch.float32, output_loading_info=True)
    model.eval()
    missing = sorted(info.get("missing_keys") or [])
    if missing:  # the oracle must be the checkpoint's own weights, every one of them
        raise RuntimeError(f"{name}: transformers did not load {missing[:5]} from the rewritten checkpoint")
    with torch.inference_mode():
        want = _greedy(model, prompt, steps)
        ref = model(torch.tensor([prompt + want])).logits[0, len(prompt) - 1 : -1].float()
        answer1 = _greedy(model, turn1, 8)
    rt = ExLlamaRuntime(out, "transformers")
    try:
        answer_text = rt.decode(answer1)
        turn2_messages = [
            *turn1_messages,
            {"role": "assistant", "content": answer_text},
            {"role": "user", "content": "And how wide?"},
        ]
        turn2 = rt.encode(rt.chat_prompt(turn2_messages))
    finally:
        rt.close()
    with torch.inference_mode():
        turn2_tokens = _greedy(model, turn2, 8)
    save_file({"ref": ref.contiguous()}, str(out / "oracle.safetensors"))
    shared = next((i for i, (a, b) in enumerate(zip(turn1, turn2)) if a != b), min(len(turn1), len(turn2)))
    record = {
        "family": name,
        "architecture": config.get("architectures", ["?"])[0],
        "config": arch.model,
        "transformers": __import__("transformers").__version__,
        "seed": seed,
        "prompt_ids": prompt,
        "greedy_tokens": want,
        "logits_std": round(float(ref.std()), 5),
        "turn1_ids": turn1,
        "turn1_tokens": answer1,
        "turn2_ids": turn2,
        "turn2_tokens": turn2_tokens,
        "turns_share_tokens": shared,
        "overlay": {k: {"value": v, "why": why} for k, (v, why) in overlay.items()},
        "keys_rewritten": renamed,
        "biases_seeded": {"count": biases, "std": BIAS_STD, "why": GPT_OSS_WHY} if biases else None,
        "mtp_num_hidden_layers": config.get("mtp_num_hidden_layers", 0),
        "build_seconds": round(time.perf_counter() - t0, 1),
    }
    (out / "oracle.json").write_text(json.dumps(record, indent=1))
    del model
    return record


def _greedy(model: Any, ids: list[int], steps: int) -> list[int]:
    import torch

    out = model.generate(
        torch.tensor([ids]),
        max_new_tokens=steps,
        min_new_tokens=steps,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(ids) :].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--families", default="", help="comma-separated names (default: all)")
    ap.add_argument("--steps", type=int, default=STEPS)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    names = [n for n in FAMILIES if not args.families or n in args.families.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        record = build(name, args.out / name, seed=7 + i, steps=args.steps)
        size = sum(f.stat().st_size for f in (args.out / name).rglob("*") if f.is_file())
        log.info(
            "%s: %s, %.2f MiB, %s s, overlay %s",
            name,
            record["architecture"],
            size / 2**20,
            record["build_seconds"],
            sorted(record["overlay"]),
        )
    total = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    log.info("all: %.2f MiB in %s", total / 2**20, args.out)


if __name__ == "__main__":
    main()
