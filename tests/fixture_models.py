"""Build Llama-layout test models from a seed: random weights, real layout, real tokenizer files.

Used by the GPU tests and benchmarks on the lent GPU (nothing is downloaded), and by CPU tests for
small shapes. ``make_llama(..., gptq=True)`` writes a 4-bit GPTQ-packed model and, beside it, its
dequantized fp16 twin, which is what the oracle runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Shape:
    hidden: int = 1024
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    inter: int = 2816
    vocab: int = 4096
    context: int = 4096

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SMALL_GQA = Shape()
SMALL_MHA = Shape(kv_heads=8)
# SmolLM2-135M's dims: hidden 576 is not a multiple of 128 (exllamav3 pads it), head_dim 64
SMALL_PADDED = Shape(hidden=576, layers=4, heads=9, kv_heads=3, inter=1536)
LLAMA2_7B = Shape(hidden=4096, layers=32, heads=32, kv_heads=32, inter=11008, vocab=32000, context=4096)


def write_tokenizer(out: Path, vocab: int) -> None:
    """A byte-level BPE tokenizer.json with exactly ``vocab`` ids (every id decodes) and Llama specials."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokens = ["<unk>", "<s>", "</s>"] + sorted(alphabet)
    merges = []
    # Merge some letter pairs so ordinary words become multi-character tokens.
    letters = [c for c in "etaoinshrdlucmfwypvbgk"]
    for a in letters:
        for b in letters:
            if len(tokens) >= vocab:
                break
            tokens.append(a + b)
            merges.append((a, b))
    i = 0
    while len(tokens) < vocab:
        tokens.append(f"x{i}")
        i += 1
    vocab_map = {t: n for n, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab_map, merges=merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": True,
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": "{% for m in messages %}<s>[{{ m['role'] }}] {{ m['content'] }}</s>{% endfor %}"
                "{% if add_generation_prompt %}<s>[assistant] {% endif %}",
            }
        )
    )
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))


def _config(shape: Shape, **extra: Any) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.inter,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "max_position_embeddings": shape.context,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": shape.vocab,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "initializer_range": 0.02,
        "torch_dtype": "float16",
        **extra,
    }


def _pack_rows(q: Any) -> Any:
    """Pack 4-bit ints [rows, cols] along rows into int32 [rows/8, cols] (GPTQ qweight layout)."""
    import torch

    q = q.to(torch.int32)
    out = torch.zeros((q.shape[0] // 8, q.shape[1]), dtype=torch.int32, device=q.device)
    for j in range(8):
        out |= q[j::8] << (4 * j)
    return out


def _pack_cols(q: Any) -> Any:
    """Pack 4-bit ints [rows, cols] along cols into int32 [rows, cols/8] (GPTQ qzeros layout)."""
    return _pack_rows(q.t().contiguous()).t().contiguous()


def make_llama(
    out: Path,
    shape: Shape = SMALL_GQA,
    seed: int = 0,
    gptq: bool = False,
    group_size: int = 128,
    device: str = "cuda",
    write_twin: bool = True,
    zero_after: int | None = None,
) -> Path:
    """Write a random-weight Llama model to ``out`` (and ``out``-fp16 twin when ``gptq``). Returns ``out``.

    ``zero_after=k``: layers k and later get zero output projections (o_proj, down_proj), so they add
    nothing to the residual stream and the model computes what its first k layers compute (see
    :func:`first_layers`: the best case for a draft model).
    """
    import torch
    from safetensors.torch import save_file

    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*size: int, std: float) -> Any:
        return (torch.randn(*size, generator=g, device=device) * std).to(torch.float16)

    h, kvd = shape.hidden, shape.kv_heads * shape.head_dim
    dense: dict[str, Any] = {
        "model.embed_tokens.weight": randn(shape.vocab, h, std=1.0),
        "model.norm.weight": torch.ones(h, dtype=torch.float16, device=device),
        "lm_head.weight": randn(shape.vocab, h, std=0.1),
    }
    quant: dict[str, Any] = dict(dense)
    linears = {
        "self_attn.q_proj": (h, h),
        "self_attn.k_proj": (h, kvd),
        "self_attn.v_proj": (h, kvd),
        "self_attn.o_proj": (h, h),
        "mlp.gate_proj": (h, shape.inter),
        "mlp.up_proj": (h, shape.inter),
        "mlp.down_proj": (shape.inter, h),
    }
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            dense[p + norm + ".weight"] = quant[p + norm + ".weight"] = torch.ones(
                h, dtype=torch.float16, device=device
            )
        for name, (fan_in, fan_out) in linears.items():
            std = 1.0 / fan_in**0.5
            if not gptq:
                dense[p + name + ".weight"] = randn(fan_out, fan_in, std=std)
                if zero_after is not None and i >= zero_after and name in ("self_attn.o_proj", "mlp.down_proj"):
                    dense[p + name + ".weight"].zero_()
                continue
            groups = fan_in // group_size
            q = torch.randint(0, 16, (fan_in, fan_out), generator=g, device=device)
            # stored zero 6 or 7, effective (z+1) 7 or 8: centred on the mean of q, so weights have ~zero mean
            z = torch.randint(6, 8, (groups, fan_out), generator=g, device=device)
            s = (torch.rand((groups, fan_out), generator=g, device=device) * 0.5 + 0.75) * (std / 4.6)
            s = s.to(torch.float16)
            gi = torch.arange(fan_in, device=device) // group_size
            if write_twin:
                w = (q - (z[gi] + 1)).to(torch.float32) * s[gi].float()
                dense[p + name + ".weight"] = w.t().contiguous().to(torch.float16)
            quant[p + name + ".qweight"] = _pack_rows(q)
            quant[p + name + ".qzeros"] = _pack_cols(z)
            quant[p + name + ".scales"] = s
            quant[p + name + ".g_idx"] = gi.to(torch.int32)

    def write(dir_: Path, tensors: dict[str, Any], config: dict[str, Any]) -> None:
        dir_.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.contiguous().cpu() for k, v in tensors.items()},
            str(dir_ / "model.safetensors"),
            metadata={"format": "pt"},
        )
        (dir_ / "config.json").write_text(json.dumps(config, indent=1))
        write_tokenizer(dir_, shape.vocab)

    if gptq:
        qcfg = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False, "sym": False}
        write(out, quant, _config(shape, quantization_config=qcfg))
        if write_twin:
            write(twin(out), dense, _config(shape))
    else:
        write(out, dense, _config(shape))
    return out


CONVERT_WITH_FIXES = """
import runpy, sys
from exllamav3 import Model
from exllama_integrations.backends.exllamav3 import patches
built = Model.from_config  # a staticmethod (1.6.5)
def from_config(*args, **kwargs):
    model = built(*args, **kwargs)
    patches.strip_empty_key_prefix(model)
    return model
Model.from_config = staticmethod(from_config)
sys.argv[0] = "convert_model"
runpy.run_module("exllamav3.conversion.convert_model", run_name="__main__", alter_sys=True)
"""
"""exllamav3's converter (``python -m exllamav3.conversion.convert_model``) with the key fix the runtime applies at
load: a model it builds keeps the checkpoint's own tensor keys."""


def convert_exl3(
    src: Path, out: Path, bits: float = 4, cal_rows: int = 32, cal_cols: int = 512, timeout: float = 1200
) -> float:
    """Quantize ``src`` to EXL3 with exllamav3's own converter into ``out``; returns the seconds it took.

    The converter leaves some tokenizer files behind; they are copied over. It runs with the runtime's key fix
    (``patches.strip_empty_key_prefix``, applied to every model it builds: Gemma 3's keys), as loading does.
    Raises RuntimeError with the converter's output when it fails.
    """
    import subprocess
    import sys
    import time

    work = out.with_name(out.name + "-work")
    cmd = [sys.executable, "-c", CONVERT_WITH_FIXES, "-i", str(src), "-o", str(out)]
    cmd += ["-w", str(work), "-b", str(bits), "-cr", str(cal_rows), "-cc", str(cal_cols)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"EXL3 conversion failed (rc={proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if not (out / f).exists() and (src / f).exists():
            (out / f).write_bytes((src / f).read_bytes())
    return time.perf_counter() - t0


def twin(gptq_dir: Path) -> Path:
    """The dequantized fp16 twin of a GPTQ fixture."""
    return gptq_dir.with_name(gptq_dir.name + "-fp16")


def first_layers(src: Path, out: Path, layers: int) -> Path:
    """A copy of the fp16 model ``src`` with only its first ``layers`` layers (same embeddings, norm, head)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    keep = {k: v for k, v in tensors.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    out.mkdir(parents=True, exist_ok=True)
    save_file(keep, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (out / f).write_bytes((src / f).read_bytes())
    return out


def make_lora(
    model_dir: Path,
    out: Path,
    seed: int = 0,
    r: int = 8,
    alpha: float = 16.0,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    device: str = "cuda",
) -> Path:
    """A random PEFT LoRA adapter for a fixture, and its merged twin ``<fp16 dir>-lora`` (see :func:`merged`).

    ``model_dir`` is an fp16 fixture, or a GPTQ one (its fp16 twin is the base). The merged twin holds
    W + (alpha / r) * B @ A, which is what the oracle runs. Targets are attention (q/k/v/o_proj) or MLP
    (gate/up/down_proj) projections.
    """
    import torch
    from safetensors.torch import load_file, save_file

    g = torch.Generator(device=device).manual_seed(seed)
    base = twin(model_dir) if twin(model_dir).is_dir() else model_dir
    dense = {k: v.to(device) for k, v in load_file(str(base / "model.safetensors")).items()}
    config = json.loads((base / "config.json").read_text())
    adapter: dict[str, Any] = {}
    for i in range(config["num_hidden_layers"]):
        for t in targets:
            key = f"model.layers.{i}.{'mlp' if t in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{t}"
            w = dense[key + ".weight"]
            a = (torch.randn(r, w.shape[1], generator=g, device=device) / w.shape[1] ** 0.5).to(torch.float16)
            b = (torch.randn(w.shape[0], r, generator=g, device=device) * 0.05).to(torch.float16)
            adapter[f"base_model.model.{key}.lora_A.weight"] = a
            adapter[f"base_model.model.{key}.lora_B.weight"] = b
            dense[key + ".weight"] = (w.float() + (alpha / r) * (b.float() @ a.float())).to(torch.float16)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.cpu().contiguous() for k, v in adapter.items()}, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": r,
                "lora_alpha": alpha,
                "target_modules": list(targets),
                "bias": "none",
                "fan_in_fan_out": False,
                "task_type": "CAUSAL_LM",
            }
        )
    )
    dest = merged(model_dir)
    dest.mkdir(parents=True, exist_ok=True)
    save_file({k: v.cpu().contiguous() for k, v in dense.items()}, str(dest / "model.safetensors"))
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (dest / f).write_bytes((base / f).read_bytes())
    return out


def merged(model_dir: Path) -> Path:
    """Where :func:`make_lora` writes a fixture's merged-weights twin."""
    base = twin(model_dir) if twin(model_dir).is_dir() else model_dir
    return base.with_name(base.name + "-lora")


TINY_SMOLLM2 = "SmolLM2-tiny-random"
"""The directory name (and so the model name) of :func:`make_tiny_smollm2`'s model."""


def make_tiny_smollm2(out: Path, demo_dir: Path, seed: int = 0) -> Path:
    """SmolLM2's own tokenizer, chat template and generation config over a random 2-layer model (hidden 64, tied
    embeddings: ~13 MB of fp32), written to ``out`` once. For the tests that check plumbing (streaming, callbacks,
    usage, stop strings, batching, servers, typed errors), not what a trained model says: ~20x faster per token
    than the demo model on a CPU. A random model never stops by itself (every reply runs to its max_tokens) and
    follows no grammar to its end; it is deterministic (a fixed seed, greedy decoding)."""
    import fcntl
    import os
    import shutil

    stamp = json.dumps({"seed": seed, "shape": _TINY, "torch": _torch_version()})  # what decides every byte

    def made() -> bool:
        return (out / ".complete").exists() and (out / ".complete").read_text() == stamp

    if made():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "a") as lock:  # two test workers: one makes it, the other waits
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not made():
            work = out.with_name(f"{out.name}.{os.getpid()}")
            shutil.rmtree(work, ignore_errors=True)
            _write_tiny_smollm2(work, demo_dir, seed)
            (work / ".complete").write_text(stamp)
            shutil.rmtree(out, ignore_errors=True)
            work.rename(out)
    return out


_TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "torch_dtype": "float32",
    "initializer_range": 0.2,  # peaked enough that greedy replies vary (0.02 repeats one token)
}


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def tiny_smollm2_dir() -> Path:
    """:func:`make_tiny_smollm2`'s model beside the demo model's (made on first use; the demo model's files and this
    seed decide every byte, so a made one is kept)."""
    from exllama_integrations.demo_model import demo_model_dir

    demo = Path(demo_model_dir())
    return make_tiny_smollm2(demo.parent.parent / "test-models" / TINY_SMOLLM2, demo)


def _write_tiny_smollm2(out: Path, demo_dir: Path, seed: int) -> None:
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = json.loads((demo_dir / "config.json").read_text())
    config.pop("architectures", None)
    config.update(_TINY)
    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(demo_dir / name, out / name)


def converted_once(src: Path, out: Path, took: dict[str, float]) -> Path:
    """``src`` converted to 4-bit EXL3 into ``out`` by exllamav3's own converter, once (``out/.complete`` says it was
    done); the seconds it took this call in ``took["convert_s"]``."""
    if not (out / ".complete").exists():
        took["convert_s"] = round(convert_exl3(src, out, bits=4, timeout=300), 1)
        (out / ".complete").write_text("1")
    return out


def arch_exl3(arch: Any, src: Path, out: Path, seed: int) -> tuple[Path, dict[str, float]]:
    """An architecture's random-weight checkpoint (tests/arch_models.py, its GPU size), built on the GPU in bf16 with
    the config keys exllamav3 reads (as the runtime adds them) into ``src``, then converted to 4-bit EXL3 into ``out``,
    each once; and the seconds each part took this call."""
    import time

    from arch_models import make_arch

    from exllama_integrations.backends.exllamav3 import patches

    took: dict[str, float] = {}
    if not (src / ".complete").exists():
        t0 = time.perf_counter()
        make_arch(arch, src, size="gpu", seed=seed, device="cuda")
        config = json.loads((src / "config.json").read_text())
        config.update(patches.config_overrides(config))
        (src / "config.json").write_text(json.dumps(config, indent=1))
        (src / ".complete").write_text("1")
        took["build_s"] = round(time.perf_counter() - t0, 1)
    return converted_once(src, out, took), took
