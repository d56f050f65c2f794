"""Several exllamav3 models behind one server on the GPU: what is measured, what is estimated, what unloading frees.

Two random-weight fp16 Llamas under a GPU budget that holds one: each engine's GPU memory is measured after its load
(its torch's reservation) and is no larger than the estimate counted for it; the second evicts the first, whose
engine process ends and whose GPU memory comes back (``nvidia-smi``); the generation of each is exllamav3's.

Run on the lent GPU: ``pytest -m gpu tests/gpu/test_gpu_multi_model.py -v -s``. Skipped without CUDA.
"""

from __future__ import annotations

import asyncio
import subprocess
import time

import pytest

from fixture_models import SMALL_GQA, SMALL_MHA, make_llama

pytestmark = pytest.mark.gpu


def smi_used_mib() -> int:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True
    ).stdout
    return int(out.split()[0])


def test_two_exllamav3_models_under_a_budget_that_holds_one(tmp_path_factory: pytest.TempPathFactory) -> None:
    from exllama_integrations import GenerationSettings
    from exllama_integrations.serve.registry.config import ServerModels, model_spec
    from exllama_integrations.serve.registry.footprint import Footprint
    from exllama_integrations.serve.registry.models import ModelRegistry

    root = tmp_path_factory.mktemp("multi")
    dirs = [make_llama(root / "a", SMALL_GQA, seed=31), make_llama(root / "b", SMALL_MHA, seed=32)]
    specs = tuple(
        model_spec({"name": d.name, "model_dir": str(d), "backend": "exllamav3", "kind": "chat"}, d.name) for d in dirs
    )
    probe = ModelRegistry(ServerModels(specs, gpu_memory=1 << 50, ram=1 << 50), budget=Footprint(1 << 50, 1 << 50))
    estimates = {e.name: e.plan.estimate for e in probe.entries.values()}
    holds_one = Footprint(max(x.gpu for x in estimates.values()) * 3 // 2, 1 << 50)
    reg = ModelRegistry(ServerModels(specs, gpu_memory=holds_one.gpu, ram=holds_one.ram), budget=holds_one)
    greedy = GenerationSettings(max_new_tokens=16, temperature=0)
    out: dict = {"estimates": {k: v.as_dict() for k, v in estimates.items()}}

    async def run() -> None:
        before = smi_used_mib()
        lease = await reg.acquire("a")
        out["a_text"] = (await asyncio.to_thread(lease.runtime.generate, "the quick brown fox", settings=greedy)).text
        a = reg.entries["a"]
        out["a_measured"] = a.measured.as_dict()
        out["a_pids"] = lease.runtime.diagnostics()["engine_pids"]
        lease.release()
        loaded_a = smi_used_mib()
        lease = await reg.acquire("b")  # no room for both: a (idle) is unloaded first
        out["states"] = {e.name: e.state for e in reg.entries.values()}
        out["b_measured"] = reg.entries["b"].measured.as_dict()
        lease.release()
        await reg.close()
        time.sleep(1)
        out["mib"] = {"before": before, "with_a": loaded_a, "after": smi_used_mib()}

    asyncio.run(run())
    print(out)
    assert out["states"] == {"a": "unloaded", "b": "loaded"}
    assert out["a_text"].strip()
    for name in ("a", "b"):
        measured, estimate = out[f"{name}_measured"], out["estimates"][name]
        assert 0 < measured["gpu_bytes"] <= estimate["gpu_bytes"], (name, measured, estimate)
    assert out["mib"]["with_a"] > out["mib"]["before"] + 100
    assert out["mib"]["after"] < out["mib"]["before"] + 100, "an unloaded model's GPU memory did not come back"
