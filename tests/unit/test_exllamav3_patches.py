"""Our fixes for exllamav3 1.6.5 that can be checked without a GPU (patches.py), on transformers' own classes.

* Gemma 4 saved by transformers 5 (``per_layer_config``, no ``global_head_dim``): exllamav3 is handed the two keys
  Google's checkpoints carry, with the values transformers reads, and a config that already has them is left alone.
* GPT-OSS in bf16: each expert's gate, up and down read from the fused tensors as ``split_fused_expert`` reads them
  compute what transformers' experts compute; exllamav3 1.6.5's own reading of a plain fused tensor (contiguous
  halves, no bias) does not, and by how much is measured here.

With ``EXLLAMAV3_SOURCE`` set to an unpacked exllamav3 1.6.5 wheel, the last test builds exllamav3's own GPT-OSS model
on the CPU (its CUDA extension stubbed, as tests/gpu/preflight_exllamav3.py does) and checks what the patched loader
puts into each expert linear. The logits on exllamav3 are checked on the GPU (tests/gpu/test_gpu_gpt_oss_bf16.py).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from exllama_integrations.backends.exllamav3 import patches

ROOT = Path(__file__).resolve().parents[2]


def _gemma4_saved(global_head_dim: int = 32, k_eq_v: bool = False, global_kv: int | None = None) -> dict:
    import transformers

    text = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "global_head_dim": global_head_dim,
        "attention_k_eq_v": k_eq_v,
        "hidden_size_per_layer_input": 0,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "vocab_size": 512,
    }
    if global_kv is not None:
        text["num_global_key_value_heads"] = global_kv
    config = transformers.Gemma4Config(text_config=text, vision_config={"hidden_size": 32}, audio_config=None)
    return json.loads(config.to_json_string())  # what save_pretrained writes


def _per_layer(config: dict) -> dict:
    import transformers

    layers = transformers.Gemma4Config(**config).text_config.per_layer_config
    return {i: (c.head_dim, c.num_key_value_heads) for i, c in enumerate(layers)}


@pytest.mark.parametrize(("k_eq_v", "global_kv"), [(False, None), (True, 1)])
def test_gemma4_saved_by_transformers_gets_its_global_attention_keys_back(k_eq_v, global_kv):
    saved = _gemma4_saved(k_eq_v=k_eq_v, global_kv=global_kv)
    text = saved["text_config"]
    assert "global_head_dim" not in text and text["per_layer_config"]  # the layout exllamav3 misreads

    overrides = patches.config_overrides(saved)
    got = overrides["text_config"]
    assert got["global_head_dim"] == 32
    assert got.get("num_global_key_value_heads") == global_kv
    assert {k: v for k, v in got.items() if k not in ("global_head_dim", "num_global_key_value_heads")} == text
    # transformers reads the overlaid config exactly as the saved one: the keys change nothing for it
    assert _per_layer({**saved, **overrides}) == _per_layer(saved)
    assert _per_layer(saved)[1][0] == 32 and _per_layer(saved)[0][0] == 16


def test_gemma4_as_checkpoints_write_it_or_unlike_one_global_override_is_left_alone():
    saved = _gemma4_saved()
    text = saved["text_config"]
    checkpoint = {**saved, "text_config": {**patches.gemma4_global_attention(saved)["text_config"]}}
    checkpoint["text_config"].pop("per_layer_config")
    assert patches.config_overrides(checkpoint) == {}  # Google's layout: exllamav3 reads it as it is
    assert _per_layer(checkpoint) == _per_layer(saved)
    layers = text["per_layer_config"]
    uneven = {"1": {"head_dim": 32}, "3": {"head_dim": 64}}
    on_sliding = {**layers, "0": {"head_dim": 8}}
    more = {i: {**row, "sliding_window": 4} for i, row in layers.items()}
    unlike = [{**saved, "text_config": {**text, "per_layer_config": rows}} for rows in (uneven, on_sliding, more)]
    for config in (*unlike, {**saved, "model_type": "gemma3"}):
        assert patches.config_overrides(config) == {}  # nothing guessed: the load fails as before, typed


def _experts(seed: int = 0):
    import torch
    import transformers

    config = transformers.GptOssConfig(
        hidden_size=64, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=1
    )
    experts = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.1 if p.dim() == 2 else 0.2))
    return experts


def _as_exllamav3(experts, x, interleaved: bool, biases: bool):
    """Each expert's output from its linears read off the fused tensors (exllamav3's (out, in) slice, ``fidx`` then
    transpose), through exllamav3's clamped SwiGLU (activation_kernels.cuh ``_oai_swiglu``)."""
    import torch

    size = experts.intermediate_size
    outs = []
    for e in range(experts.num_experts):
        gate_up_bias = experts.gate_up_proj_bias[e] if biases else None
        down_bias = experts.down_proj_bias[e] if biases else None
        fused = experts.gate_up_proj[e].T
        wg, bg = patches.split_fused_expert(fused, gate_up_bias, (0, size), interleaved)
        wu, bu = patches.split_fused_expert(fused, gate_up_bias, (size, 2 * size), interleaved)
        wd, bd = patches.split_fused_expert(experts.down_proj[e].T, down_bias, None, False)
        g = x @ wg + (bg if bg is not None else 0)
        u = x @ wu + (bu if bu is not None else 0)
        g, u = g.clamp(max=experts.limit), u.clamp(-experts.limit, experts.limit)
        h = (u + 1) * g * torch.sigmoid(1.702 * g)
        outs.append(h @ wd + (bd if bd is not None else 0))
    return torch.stack(outs)


def _reference(experts, x):
    import torch

    outs = []
    for e in range(experts.num_experts):
        gate_up = x @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e]
        outs.append(experts._apply_gate(gate_up) @ experts.down_proj[e] + experts.down_proj_bias[e])
    # and transformers' own forward agrees, each token routed to one expert with weight 1
    ones = torch.ones(x.shape[0], 1)
    for e in range(experts.num_experts):
        routed = experts(x, torch.full((x.shape[0], 1), e), ones)
        torch.testing.assert_close(routed, outs[e], rtol=1e-5, atol=1e-5)
    return torch.stack(outs)


def test_gpt_oss_experts_read_by_the_patch_compute_what_transformers_computes():
    import torch

    experts = _experts()
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = _reference(experts, x)
        got = _as_exllamav3(experts, x, interleaved=True, biases=True)
        upstream = _as_exllamav3(experts, x, interleaved=False, biases=False)  # exllamav3 1.6.5 on a plain tensor
        halves = _as_exllamav3(experts, x, interleaved=False, biases=True)
        unbiased = _as_exllamav3(experts, x, interleaved=True, biases=False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    scale = want.abs().max().item()
    # exllamav3 1.6.5's reading is off by most of the output; the halves alone too; the missing biases alone by 7%
    assert (upstream - want).abs().max().item() > 0.5 * scale
    assert (halves - want).abs().max().item() > 0.5 * scale
    assert (unbiased - want).abs().max().item() > 0.05 * scale


def test_gpt_oss_patch_fills_exllamav3s_own_expert_linears(tmp_path):
    source = os.environ.get("EXLLAMAV3_SOURCE")
    if not source:
        pytest.skip("set EXLLAMAV3_SOURCE to an unpacked exllamav3 1.6.5 wheel (pip download exllamav3==1.6.5)")
    import torch
    from arch_models import make_arch
    from safetensors.torch import load_file, save_file

    d = make_arch("gpt_oss", tmp_path / "gpt_oss", seed=3)
    tensors = load_file(str(d / "model.safetensors"))  # transformers zeroes the biases: give them values
    gen = torch.Generator().manual_seed(4)
    tensors = {k: (torch.randn(v.shape, generator=gen) if k.endswith("_bias") else v) for k, v in tensors.items()}
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})

    before, path = set(sys.modules), list(sys.path)
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    try:
        _check_exllamav3_linears(Path(source), d, tensors)
    finally:  # the stubs (triton, the extension) must not outlive this test
        for name in set(sys.modules) - before:
            del sys.modules[name]
        sys.path[:] = path


def _check_exllamav3_linears(source: Path, d: Path, tensors: dict) -> None:
    import torch
    from preflight_exllamav3 import _import_exllamav3

    ex = _import_exllamav3(source)
    from exllamav3.modules.block_sparse_mlp import BlockSparseMLP

    def linears(patched: bool):
        model = ex.Model.from_config(ex.Config.from_directory(str(d), load_method="python"))
        if patched:
            assert patches.gpt_oss_bf16_experts(model) == 2 * 4 * 3  # layers x experts x (gate, up, down)
        mlp = next(m for m in model if isinstance(m, BlockSparseMLP))
        out = []
        for e in range(mlp.num_local_experts):
            for lin in (mlp.gates[e], mlp.ups[e], mlp.downs[e]):
                lin.device = torch.device("cpu")
                assert lin.load_fp16(lin.key)
                out.append((lin.inner.weight.float(), lin.inner.bias))
        return mlp.key, out

    key, got = linears(patched=True)
    gu, gub = tensors[f"{key}.experts.gate_up_proj"].float(), tensors[f"{key}.experts.gate_up_proj_bias"].float()
    dn, dnb = tensors[f"{key}.experts.down_proj"].float(), tensors[f"{key}.experts.down_proj_bias"].float()
    want = [
        w
        for e in range(gu.shape[0])
        for w in ((gu[e][:, ::2], gub[e][::2]), (gu[e][:, 1::2], gub[e][1::2]), (dn[e], dnb[e]))
    ]
    for (w, b), (ww, wb) in zip(got, want):  # exllamav3 pads the tiny widths to 128 with zeros
        torch.testing.assert_close(w[: ww.shape[0], : ww.shape[1]], ww, rtol=1e-3, atol=1e-3)  # fp16 of bf16
        torch.testing.assert_close(b.float()[: wb.shape[0]], wb, rtol=1e-3, atol=1e-3)
        assert not w[ww.shape[0] :].any() and not w[:, ww.shape[1] :].any() and not b[wb.shape[0] :].any()
    _, plain = linears(patched=False)
    assert all(b is None for _, b in plain)  # exllamav3 1.6.5 alone: no expert bias
    gate, even = plain[0][0], want[0][0]
    assert not torch.allclose(gate[: even.shape[0], : even.shape[1]], even, atol=1e-2)  # nor the even columns
