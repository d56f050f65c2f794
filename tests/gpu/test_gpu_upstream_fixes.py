"""Two fixes of patches.py on exllamav3 1.6.5, proven against the carried fp32 oracle (issue 48).

* ``gpt_oss_bf16_experts``: GPT-OSS in bf16, read by exllamav3 alone (``Config`` -> ``Model`` -> ``load``) with and
  without the fix: the teacher-forced logits at the prompt's last position and at every step of the oracle's greedy
  tokens, against the oracle's. With it they must fall within the matrix's tolerance (5% of the oracle logits'
  standard deviation; the later rows within the 5x slack the matrix gives MoE families); without it they must not
  (else the fix is not what made the difference). It passed on an H100 on 2026-12-07 (patched 0.0004, unpatched
  0.71), and bf16 GPT-OSS is no longer refused.
* ``gemma4_global_attention``: the Gemma 4 fixture, its config rewritten as transformers 5.24 saves it
  (``per_layer_config``, no ``global_head_dim``), loads through the runtime and gives the same prefill logits as the
  fixture in its checkpoint layout.

Needs ``EXLLAMA_FAMILY_FIXTURES`` (tests/gpu/build_family_fixtures.py's folder, with ``gpt_oss`` and ``gemma4``).
One line per check goes to ``$OUT/upstream_fixes.jsonl``.

    pytest -m gpu tests/gpu/test_gpu_upstream_fixes.py
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
FIXTURES = os.environ.get("EXLLAMA_FAMILY_FIXTURES")
RESULTS = Path(os.environ.get("OUT", "/tmp/out")) / "upstream_fixes.jsonl"
MOE_SLACK = 5.0


def _fixture(name: str) -> Path:
    if not FIXTURES or not (Path(FIXTURES) / name / "oracle.json").is_file():
        pytest.skip("set EXLLAMA_FAMILY_FIXTURES to the folder tests/gpu/build_family_fixtures.py wrote")
    return Path(FIXTURES) / name


def _write(record: dict) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record))


def _oracle(path: Path):
    from safetensors.torch import load_file

    oracle = json.loads((path / "oracle.json").read_text())
    ref = load_file(str(path / "oracle.safetensors"))["ref"]
    return oracle["prompt_ids"], oracle["greedy_tokens"], ref


def _exllamav3_rows(path: Path, patched: bool, ids: list[int], want: list[int]):
    """exllamav3's logits over prompt + the oracle's tokens, at the rows the oracle kept (its own forward)."""
    import torch
    from exllamav3 import Cache, Config, Model

    from exllama_integrations.backends.exllamav3 import patches

    model = Model.from_config(Config.from_directory(str(path)))
    fixes = patches.apply(model) if patched else {}
    # As the runtime builds it, and held: load() reaches the cache through a weak reference to size its measuring
    # forwards (a Cache dropped at once failed the load of 2026-12-07 with "'NoneType' object has no attribute
    # 'max_num_tokens'"); the forward below reads no cache
    cache = Cache(model, max_num_tokens=4096)
    model.load(progressbar=False)
    try:
        with torch.inference_mode():
            logits = model.forward(torch.tensor([ids + want], dtype=torch.long), {}).float()[0].cpu()
    finally:
        model.unload()
        del cache
    return logits[len(ids) - 1 : -1], fixes


def test_gpt_oss_bf16_experts_fix_brings_exllamav3_to_the_oracle():
    path = _fixture("gpt_oss")
    ids, want, ref = _oracle(path)
    tol = 0.05 * float(ref.std())
    record: dict = {"check": "gpt_oss_bf16_experts", "tolerance": round(tol, 4), "rows": len(want)}
    for patched in (True, False):
        rows, fixes = _exllamav3_rows(path, patched, ids, want)
        diff = (rows[:, : ref.shape[1]] - ref).abs().amax(dim=-1)
        record["patched" if patched else "unpatched"] = {
            "prefill_max_logit_diff": round(float(diff[0]), 4),
            "worst_row_max_logit_diff": round(float(diff.max()), 4),
            "argmax_agree": int((rows[:, : ref.shape[1]].argmax(-1) == ref.argmax(-1)).sum()),
            "fixes": fixes,
        }
    _write(record)
    fixed, plain = record["patched"], record["unpatched"]
    assert fixed["fixes"].get("gpt_oss_bf16_experts") == 2 * 4 * 3  # 2 layers x 4 experts x gate, up, down
    assert fixed["prefill_max_logit_diff"] <= tol, record
    assert fixed["worst_row_max_logit_diff"] <= MOE_SLACK * tol, record
    assert plain["worst_row_max_logit_diff"] > MOE_SLACK * tol, record  # the fix is what made the difference


def _as_transformers_524_saves(src: Path, out: Path) -> Path:
    """``src`` with its text_config as transformers 5.24's ``save_pretrained`` writes Gemma 4's (its
    configuration_gemma4.py: global_head_dim / num_global_key_value_heads become per_layer_config, and are dropped)."""
    shutil.copytree(src, out)
    config = json.loads((src / "config.json").read_text())
    text = dict(config["text_config"])
    row = {"head_dim": text.pop("global_head_dim")}
    if "num_global_key_value_heads" in text:
        row["num_key_value_heads"] = text.pop("num_global_key_value_heads")
    text["per_layer_config"] = {str(i): row for i, t in enumerate(text["layer_types"]) if t == "full_attention"}
    (out / "config.json").write_text(json.dumps({**config, "text_config": text}, indent=1))
    return out


def test_gemma4_saved_by_transformers_loads_and_computes_as_its_checkpoint_layout(tmp_path):
    import torch

    from exllama_integrations import ExLlamaRuntime

    path = _fixture("gemma4")
    ids, _, ref = _oracle(path)
    saved = _as_transformers_524_saves(path, tmp_path / "gemma4-t524")
    record: dict = {"check": "gemma4_global_attention", "tolerance": round(0.05 * float(ref.std()), 4)}
    logits = {}
    for label, d in (("checkpoint_layout", path), ("transformers_5_24_layout", saved)):
        rt = ExLlamaRuntime(d, "exllamav3", cache_size=8192)
        try:
            with torch.inference_mode():
                out = rt.diagnostics()["model"].forward(torch.tensor([ids], dtype=torch.long)).float()[0, -1].cpu()
            logits[label] = out[: ref.shape[1]]
            record[label] = {
                "fixes": rt.model_info().details.get("upstream_fixes", {}),
                "prefill_max_logit_diff_vs_oracle": round(float((logits[label] - ref[0]).abs().max()), 4),
            }
        finally:
            rt.close()
    _write(record)
    assert record["transformers_5_24_layout"]["fixes"].get("config_keys") == 1
    assert "config_keys" not in record["checkpoint_layout"]["fixes"]
    torch.testing.assert_close(logits["transformers_5_24_layout"], logits["checkpoint_layout"], rtol=0, atol=0)
