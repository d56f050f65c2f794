"""Qwen3.5-shaped checkpoints on which MTP drafting's acceptance is known, written straight to safetensors.

Every layer of the trunk has zero output projections (``linear_attn.out_proj``, ``self_attn.o_proj``,
``mlp.down_proj``): it adds nothing to the residual stream, which stays the current token's embedding, so the next
token is a function of the current one. The LM head makes that function ``t -> t + 1`` (its row for token ``s`` is
the embedding of ``s - 1``, scaled): greedy decoding counts upward from the prompt's last token, whatever came
before it (every id of :func:`fixture_models.write_tokenizer`'s vocabulary decodes).

The MTP head (``mtp.*``, one full-attention layer, as Qwen3.5 checkpoints carry it) is built the same way: its
layer's output projections are zero and ``mtp.fc`` passes the drafted token's normed embedding through
(``[I | 0]``: the trunk's hidden state is dropped), so it predicts ``t + 1`` too and every drafted token is accepted.
With ``mtp.fc``'s embedding block ``I + sigma * G / sqrt(hidden)`` (G Gaussian) it is wrong on some tokens; ``sigma``
is chosen (:func:`calibrate`) so that exllamav3's accounting of the drafted windows (:func:`window_acceptance`, read
from ``Generator.iterate_gen`` 1.6.5) over the very tokens a run generates comes out at a target rate (0.70).

Nothing here needs transformers (the GPU machine's 5.17 lacks Qwen3.5); ``transformers``' own ``Qwen3_5ForCausalLM``
reads these directories (a CPU test checks it counts upward). The trunk's weights are a shard of their own,
hard-linked into every variant built beside it (:func:`make_variant`), so several MTP heads cost one trunk on disk.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fixture_models import write_tokenizer

TRUNK, HEAD = "model-trunk.safetensors", "model-mtp.safetensors"
# Every tensor is written in bf16, as Qwen3.5 checkpoints ship: exllamav3 1.6.5's Gated DeltaNet kernels take dt_bias
# and A_log only in bf16 (gdn.cu: TORCH_CHECK_DTYPE(dt_bias, kBFloat16); the fp16 fixtures of 2026-12-07 were refused
# at load with "dt_bias is incorrect datatype, must be kBFloat16"), and it reads bf16 linear weights as fp16.
PREFIX = "model.language_model."


@dataclass(frozen=True)
class QwenShape:
    hidden: int
    layers: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int
    lin_k_heads: int
    lin_v_heads: int
    lin_head_dim: int
    vocab: int
    interval: int = 4  # every 4th layer full attention, the others Gated DeltaNet
    context: int = 4096

    @property
    def layer_types(self) -> list[str]:
        return ["full_attention" if (i + 1) % self.interval == 0 else "linear_attention" for i in range(self.layers)]

    @property
    def params(self) -> int:
        """Parameters of the trunk (embedding and head included)."""
        return sum(_numel(s) for s in self.trunk_shapes().values())

    def trunk_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {PREFIX + "embed_tokens.weight": (self.vocab, self.hidden), PREFIX + "norm.weight": (self.hidden,)}
        shapes["lm_head.weight"] = (self.vocab, self.hidden)
        for i, kind in enumerate(self.layer_types):
            shapes.update(self._layer(f"{PREFIX}layers.{i}.", kind))
        return shapes

    def head_shapes(self) -> dict[str, tuple[int, ...]]:
        h = self.hidden
        shapes = {"mtp.fc.weight": (h, 2 * h)}
        shapes.update({f"mtp.{n}.weight": (h,) for n in ("pre_fc_norm_hidden", "pre_fc_norm_embedding", "norm")})
        shapes.update(self._layer("mtp.layers.0.", "full_attention"))
        return shapes

    def _layer(self, p: str, kind: str) -> dict[str, tuple[int, ...]]:
        h, i = self.hidden, self.inter
        out = {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        out |= {
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
        if kind == "full_attention":
            q, kv, d = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.head_dim
            a = p + "self_attn."
            out |= {a + "q_proj.weight": (2 * q, h), a + "k_proj.weight": (kv, h), a + "v_proj.weight": (kv, h)}
            out |= {a + "o_proj.weight": (h, q), a + "q_norm.weight": (d,), a + "k_norm.weight": (d,)}
            return out
        k, v, n = self.lin_k_heads * self.lin_head_dim, self.lin_v_heads * self.lin_head_dim, self.lin_v_heads
        a = p + "linear_attn."
        out |= {a + "in_proj_qkv.weight": (2 * k + v, h), a + "in_proj_z.weight": (v, h), a + "out_proj.weight": (h, v)}
        out |= {a + "in_proj_a.weight": (n, h), a + "in_proj_b.weight": (n, h), a + "conv1d.weight": (2 * k + v, 1, 4)}
        out |= {a + "A_log": (n,), a + "dt_bias": (n,), a + "norm.weight": (self.lin_head_dim,)}
        return out


TINY = QwenShape(64, 4, 128, 4, 2, 16, 2, 4, 16, 512)
"""``arch_families.ARCHS_2026["qwen3_5"]``'s tiny size (a CPU test compares the two layouts key for key)."""
GPU_TEST = QwenShape(1024, 8, 3072, 8, 2, 128, 4, 8, 128, 32000)
HYBRID_1B = QwenShape(2048, 24, 6144, 8, 2, 256, 16, 16, 128, 32000)
"""A ~1.5B Qwen3.5-shaped hybrid (18 Gated DeltaNet and 6 attention layers) for the captured step's speed rows."""
BENCH = QwenShape(2560, 32, 9216, 16, 4, 256, 16, 32, 128, 248320)
"""The benchmark's: Qwen3.5's 248,320-token vocabulary, 24 Gated DeltaNet and 8 attention layers, 4.8B parameters
(9.0 GiB in bf16)."""


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def config(shape: QwenShape, mtp_layers: int = 1) -> dict[str, Any]:
    """config.json of a text-only Qwen3.5 checkpoint (``Qwen3_5ForCausalLM``), as transformers 5.24 writes it."""
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.inter,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "layer_types": shape.layer_types,
        "full_attention_interval": shape.interval,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": shape.lin_head_dim,
        "linear_value_head_dim": shape.lin_head_dim,
        "linear_num_key_heads": shape.lin_k_heads,
        "linear_num_value_heads": shape.lin_v_heads,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": shape.context,
        "rope_parameters": {"rope_theta": 10000000.0, "partial_rotary_factor": 0.25, "rope_type": "default"},
        "attention_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": shape.vocab,
        "mtp_num_hidden_layers": mtp_layers,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "dtype": "bfloat16",
    }


def _tensors(shapes: dict[str, tuple[int, ...]], g: Any, device: str, counting: bool = True) -> dict[str, Any]:
    """Random weights as the family initialises them; every output projection zero when ``counting``."""
    import torch

    out = {}
    for name, shape in shapes.items():
        leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
        if counting and leaf in ("o_proj", "down_proj", "out_proj"):
            t = torch.zeros(shape, device=device)
        elif name.endswith("linear_attn.norm.weight") or leaf == "dt_bias":
            t = torch.ones(shape, device=device)
        elif leaf == "A_log":
            t = torch.empty(shape, device=device).uniform_(1, 16, generator=g).log()
        elif len(shape) == 1:  # the (1 + w) RMSNorms: scale 1
            t = torch.zeros(shape, device=device)
        else:
            t = torch.randn(shape, generator=g, device=device) * 0.02
        out[name] = t.bfloat16()
    return out


def make_trunk(out: Path, shape: QwenShape, seed: int = 0, device: str = "cpu") -> Path:
    """The trunk of a counting checkpoint (see the module docstring) in ``out/model-trunk.safetensors``."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator(device=device).manual_seed(seed)
    shapes = shape.trunk_shapes()
    big = {PREFIX + "embed_tokens.weight", "lm_head.weight"}
    tensors = _tensors({k: v for k, v in shapes.items() if k not in big}, g, device)
    embed = torch.randn(shape.vocab, shape.hidden, generator=g, device=device)
    tensors[PREFIX + "embed_tokens.weight"] = embed.bfloat16()
    tensors["lm_head.weight"] = (embed.roll(1, 0) / shape.hidden**0.5).bfloat16()  # row s: embedding of s - 1
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(out / TRUNK), metadata={"format": "pt"})
    write_tokenizer(out, shape.vocab)
    return out


def make_random(out: Path, shape: QwenShape, seed: int = 0, device: str = "cpu") -> Path:
    """A Qwen3.5-shaped model with every weight random (no MTP head): for speed, where the values do not matter but
    all-zero projections would (an EXL3 conversion of one, kernels that skip zeros)."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator(device=device).manual_seed(seed)
    tensors = _tensors(shape.trunk_shapes(), g, device, counting=False)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(out / "model.safetensors"), {"format": "pt"})
    (out / "config.json").write_text(json.dumps(config(shape, mtp_layers=0), indent=1))
    write_tokenizer(out, shape.vocab)
    return out


def make_variant(
    trunk: Path, out: Path, shape: QwenShape, sigma: float | None, seed: int = 0, device: str = "cpu"
) -> Path:
    """A checkpoint of ``trunk`` with an MTP head whose ``mtp.fc`` embedding block is ``I + sigma * G / sqrt(hidden)``
    (0: a perfect drafter) or, with ``sigma=None``, none (config.json still names one: a quantization that dropped
    the head)."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in os.listdir(trunk):
        if f != "config.json" and not (out / f).exists():
            try:
                os.link(trunk / f, out / f)  # one trunk on disk for every variant
            except OSError:
                shutil.copy2(trunk / f, out / f)
    weight_map = dict.fromkeys(shape.trunk_shapes(), TRUNK)
    if sigma is not None:
        g = torch.Generator(device=device).manual_seed(seed + 1)
        head = _tensors({k: v for k, v in shape.head_shapes().items() if k != "mtp.fc.weight"}, g, device)
        head["mtp.fc.weight"] = fc_weight(shape, sigma, seed, device).bfloat16()
        save_file({k: v.contiguous().cpu() for k, v in head.items()}, str(out / HEAD), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(head, HEAD)
    elif (out / HEAD).exists():
        (out / HEAD).unlink()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(config(shape), indent=1))
    return out


def fc_weight(shape: QwenShape, sigma: float, seed: int = 0, device: str = "cpu") -> Any:
    """``mtp.fc``: ``[I + sigma * G / sqrt(hidden) | 0]`` (embedding block, then the hidden state's, dropped)."""
    import torch

    h = shape.hidden
    g = torch.Generator(device=device).manual_seed(seed + 2)
    block = torch.eye(h, device=device) + sigma * torch.randn(h, h, generator=g, device=device) / h**0.5
    return torch.cat([block, torch.zeros(h, h, device=device)], dim=1)


class Probe:
    """Which tokens an MTP head of a given ``sigma`` drafts right, computed from the trunk's own fp16 weights in fp32.

    The head's state after token ``t`` is ``fc`` of ``t``'s normed embedding (its layer adds nothing, the norms only
    scale), and the LM head picks the draft; right means ``t + 1``. ``device`` must be the one the variants were
    built on (the generator's draws differ between devices).
    """

    def __init__(self, trunk: Path, shape: QwenShape, seed: int = 0, device: str = "cpu") -> None:
        from safetensors import safe_open

        self.shape, self.seed, self.device = shape, seed, device
        with safe_open(str(trunk / TRUNK), "pt", device=device) as f:
            self.embed = f.get_tensor(PREFIX + "embed_tokens.weight").float()
            self.head = f.get_tensor("lm_head.weight").float()
        self.noise = fc_weight(shape, 1.0, seed, device)[:, : shape.hidden]
        self.noise.diagonal().sub_(1.0)  # G / sqrt(hidden), the part sigma scales

    def right(self, tokens: Sequence[int], sigma: float) -> list[bool]:
        """For each of ``tokens``: whether the head drafts the token after it."""
        import torch

        ids = torch.tensor(list(tokens), device=self.device)
        x = self.embed[ids]
        x = x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
        picked = ((x + sigma * (x @ self.noise.T)) @ self.head.T).argmax(-1)
        return [bool(p) for p in (picked == (ids + 1) % self.shape.vocab).tolist()]


def window_acceptance(right: Callable[[int], bool], start: int, new: int, window: int) -> tuple[int, int]:
    """exllamav3's accepted and rejected draft tokens (1.6.5's ``iterate_gen``) for a greedy job of ``new`` tokens on
    a counting model, its first step's input ``start``, ``window`` tokens drafted a step; ``right(t)``: the drafter
    drafts ``t + 1`` after ``t``.

    A step feeds the input and its ``window`` drafts; the target's token at each position is emitted, and the next
    draft is accepted while it matches; the first mismatch rejects the rest of the window, as does the job's end.
    """
    accepted = rejected = emitted = 0
    token = start
    while emitted < new:
        lead = 0  # drafts right in a row from this input
        while lead < window and right(token + lead):
            lead += 1
        for i in range(window + 1):
            emitted += 1
            if emitted == new:  # the last token: the positions after it are never resolved
                rejected += window - i
                break
            if i == window:
                break
            if i < lead:
                accepted += 1
            else:
                rejected += window - i
                break
        token += i + 1
    return accepted, rejected


def calibrate(probe: Probe, start: int, new: int, window: int, target: float) -> tuple[float, float]:
    """The ``sigma`` whose head gets ``target`` of its drafts accepted over this job's tokens, and that rate."""
    tokens = list(range(start, start + new + window + 1))

    def rate(sigma: float) -> float:
        right = dict(zip(tokens, probe.right(tokens, sigma)))
        a, r = window_acceptance(lambda t: right.get(t, False), start, new, window)
        return a / max(1, a + r)

    lo, hi = 0.0, 1.0
    while rate(hi) > target and hi < 1e4:
        lo, hi = hi, hi * 2
    for _ in range(20):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rate(mid) > target else (lo, mid)
    best = min((lo, hi), key=lambda s: abs(rate(s) - target))
    return best, rate(best)


__all__ = [
    "BENCH",
    "GPU_TEST",
    "HYBRID_1B",
    "TINY",
    "Probe",
    "QwenShape",
    "calibrate",
    "make_random",
    "make_trunk",
    "make_variant",
    "window_acceptance",
]
