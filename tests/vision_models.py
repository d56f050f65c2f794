"""Random-weight vision-language models with their processors, built through transformers' own classes.

``make_vision(name, out)`` writes a model directory (``save_pretrained`` of ``<Arch>ForConditionalGeneration``),
a byte-level BPE tokenizer with the family's specials (image placeholders included), its processor's files and
a chat template of the family's shape that places ``{"type": "image"}`` parts. Tiny sizes run in CI on the CPU
backend; ``size="gpu"`` is a realistic width for the oracle tests on the H200.

Qwen2.5-VL's processor needs torchvision in transformers 5 (its video processor), which has no CPU build for
the pinned torch here; Gemma 3's does not, so Gemma 3 runs the image path end to end in CI.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from arch_models import _CHATML_SPECIALS, Arch, _tokenizer

_CONTENT = (
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}IMAGE{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
)
GEMMA3_VL = (
    "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "<start_of_turn>{{ role }}\n" + _CONTENT.replace("IMAGE", "<start_of_image>") + "<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
QWEN25_VL = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    + _CONTENT.replace("IMAGE", "<|vision_start|><|image_pad|><|vision_end|>")
    + "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GEMMA3_SPECIALS = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
)
QWEN_SPECIALS = (*_CHATML_SPECIALS, "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {
        "text": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
        },
        "gemma_vision": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 64,
            "patch_size": 8,
        },
        "qwen_vision": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2},
    },
    "gpu": {
        "text": {
            "hidden_size": 1024,
            "intermediate_size": 2816,
            "num_hidden_layers": 8,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "max_position_embeddings": 8192,
        },
        "gemma_vision": {  # SigLIP-shaped: 32 x 32 patches pooled to 16 x 16 = 256 image tokens, as Gemma 3's
            "hidden_size": 768,
            "intermediate_size": 3072,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "image_size": 448,
            "patch_size": 14,
        },
        "qwen_vision": {"depth": 4, "hidden_size": 384, "intermediate_size": 1536, "num_heads": 6},
    },
}


def _gemma3(out: Path, size: str, vocab: int) -> tuple[Any, Any]:
    import transformers

    ids = _tokenizer(out, vocab, Arch("", "", {}, {}, GEMMA3_SPECIALS, "<end_of_turn>", GEMMA3_VL, bos="<bos>"))
    extra = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tc = json.loads((out / "tokenizer_config.json").read_text())
    tc.update(extra, pad_token="<pad>", extra_special_tokens=extra)
    (out / "tokenizer_config.json").write_text(json.dumps(tc))
    s = SIZES[size]
    text = {
        **s["text"],
        "head_dim": s["text"]["hidden_size"] // s["text"]["num_attention_heads"],
        "vocab_size": vocab,
        "sliding_window": 64 if size == "tiny" else 512,
        "query_pre_attn_scalar": 16 if size == "tiny" else 128,
    }
    vision = {**s["gemma_vision"], "vision_use_head": False}  # as Gemma 3's own checkpoints
    per_side = 4 if size == "tiny" else 16
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=per_side * per_side,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
        eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]],
        bos_token_id=ids["<bos>"],
        pad_token_id=ids["<pad>"],
        tie_word_embeddings=False,
    )
    px = vision["image_size"]
    image_processor = getattr(transformers, "Gemma3ImageProcessorPil", None) or transformers.Gemma3ImageProcessor
    images = image_processor(size={"height": px, "width": px})
    images.save_pretrained(str(out))  # preprocessor_config.json, which exllamav3 reads
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    processor = transformers.Gemma3Processor(
        image_processor=images,
        tokenizer=tok,
        chat_template=GEMMA3_VL,
        image_seq_length=per_side * per_side,
    )
    return config, processor


def _qwen25_vl(out: Path, size: str, vocab: int) -> tuple[Any, Any]:
    import transformers

    ids = _tokenizer(out, vocab, Arch("", "", {}, {}, QWEN_SPECIALS, "<|im_end|>", QWEN25_VL))
    s = SIZES[size]
    head = s["text"]["hidden_size"] // s["text"]["num_attention_heads"]
    third = head // 2 // 3
    text = {
        **s["text"],
        "vocab_size": vocab,
        "eos_token_id": ids["<|im_end|>"],
        "bos_token_id": None,
        "rope_scaling": {"type": "mrope", "mrope_section": [head // 2 - 2 * third, third, third]},
    }
    vision = {
        **s["qwen_vision"],
        "out_hidden_size": s["text"]["hidden_size"],
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 56,
        "fullatt_block_indexes": [s["qwen_vision"]["depth"] - 1],
    }
    config = transformers.Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=ids["<|im_end|>"],
        tie_word_embeddings=False,
    )
    pixels = 56 * 56 if size == "tiny" else 448 * 448
    image_processor = transformers.Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=pixels)
    # the processor class needs torchvision (its video half); save the parts it is built from instead
    image_processor.save_pretrained(str(out))
    (out / "chat_template.jinja").write_text(QWEN25_VL)
    (out / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2_5_VLProcessor"}))
    return config, None


BUILDERS = {
    "gemma3": (_gemma3, "Gemma3ForConditionalGeneration"),
    "qwen2_5_vl": (_qwen25_vl, "Qwen2_5_VLForConditionalGeneration"),
}


def make_vision(name: str, out: Path, size: str = "tiny", seed: int = 0, device: str = "cpu") -> Path:
    """Write a random-weight vision-language ``name`` model (and its processor) to ``out``; returns ``out``."""
    import torch
    import transformers

    build, cls = BUILDERS[name]
    out.mkdir(parents=True, exist_ok=True)
    config, processor = build(out, size, 512 if size == "tiny" else 32000)
    torch.manual_seed(seed)
    dtype = torch.float32 if size == "tiny" else torch.bfloat16
    with torch.device(device):
        model = getattr(transformers, cls)(config).to(dtype)
    for _, param in model.named_parameters():  # transformers starts some projections at zero (Gemma 3's image
        if param.dim() >= 2 and not param.detach().abs().amax():  # one): with them, an image would change nothing
            torch.nn.init.normal_(param, std=0.05)
    model.eval()
    model.save_pretrained(str(out), safe_serialization=True)
    if processor is not None:
        processor.save_pretrained(str(out))
    del model
    if name == "gemma3":
        _hub_layout(out)
    return out


def _hub_key(key: str) -> str:
    """Gemma 3's tensor name as its checkpoints on the Hub spell it (what users have, and exllamav3 reads)."""
    for new, old in (
        ("model.language_model.", "language_model.model."),
        ("model.vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
        ("lm_head.", "language_model.lm_head."),
    ):
        if key.startswith(new):
            key = old + key[len(new) :]
    if key.startswith("vision_tower.") and not key.startswith("vision_tower.vision_model."):
        key = "vision_tower.vision_model." + key[len("vision_tower.") :]
    return key


def _hub_layout(out: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    tensors = load_file(str(path))
    save_file({_hub_key(k): v for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


def image_bytes(
    width: int = 96, height: int = 64, color: tuple[int, int, int] = (200, 40, 40), fmt: str = "PNG"
) -> bytes:
    """An image file's bytes: a two-colour picture (so two colours give two different images)."""
    import io

    from PIL import Image, ImageDraw

    img = Image.new("RGB", (width, height), color)
    ImageDraw.Draw(img).rectangle((width // 4, height // 4, width // 2, height // 2), fill=(20, 20, 220))
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


__all__ = ["BUILDERS", "GEMMA3_VL", "QWEN25_VL", "image_bytes", "make_vision"]
