"""Small embedding and rerank models for the tests: random weights through transformers' own classes, real files.

``make_cross_encoder``: a BERT with a one-logit sequence-classification head and all-MiniLM-L6-v2's real
tokenizer (what sentence-transformers' ``CrossEncoder`` loads). ``make_decoder_embedder``: a Qwen3 (``arch_models``)
with a sentence-transformers pipeline (last-token pooling, Normalize, a query prompt), as Qwen3-Embedding ships.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from arch_models import make_arch

QUERY_PROMPT = "Instruct: Given a question, retrieve passages that answer it\nQuery:"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def make_cross_encoder(out: Path, tokenizer_from: Path, seed: int = 0) -> Path:
    """A random-weight BertForSequenceClassification (one label) with the tokenizer of ``tokenizer_from``."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    out.mkdir(parents=True, exist_ok=True)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        num_labels=1,
        initializer_range=0.3,  # scores spread well apart, so an order is not decided by rounding
    )
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config).eval()
    model.save_pretrained(str(out), safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, out / name)
    return out


def make_decoder_embedder(
    out: Path, seed: int = 0, matryoshka: bool = False, size: str = "tiny", device: str = "cpu"
) -> Path:
    """A random-weight Qwen3 with Qwen3-Embedding's sentence-transformers files (last token, Normalize, prompts)."""
    make_arch("qwen3", out, size=size, seed=seed, device=device)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["pad_token"] = "<|endoftext|>"
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir(exist_ok=True)
    hidden = json.loads((out / "config.json").read_text())["hidden_size"]
    pooling = {"word_embedding_dimension": hidden, "pooling_mode_lasttoken": True, "include_prompt": True}
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128, "do_lower_case": False}))
    prompts = {"prompts": {"query": QUERY_PROMPT, "document": ""}, "default_prompt_name": None}
    (out / "config_sentence_transformers.json").write_text(json.dumps(prompts))
    if matryoshka:
        config = json.loads((out / "config.json").read_text())
        config["matryoshka_dimensions"] = [16, 32]
        (out / "config.json").write_text(json.dumps(config))
    return out


def with_yes_no(path: Path) -> Path:
    """The model's tokenizer with single tokens "yes" and "no" (two filler tokens renamed), for a yes/no reranker."""
    data = json.loads((path / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    for word, filler in (("yes", "x0"), ("no", "x1")):
        vocab[word] = vocab.pop(filler)
    (path / "tokenizer.json").write_text(json.dumps(data))
    return path
