"""The backend contract on every GPU backend: readers hold nothing, close() is safe mid-stream, configs are
checked before loading, and decode steps match the oracle's logits step by step (not only at prefill).

Run on the lent GPU: ``pytest -m gpu tests/gpu``. Skipped without CUDA.
"""

from __future__ import annotations

import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_gpu_backends import CASES, PROMPT, _oracle_dir

pytestmark = pytest.mark.gpu
STEPS = 32


def _gpu_mb() -> float:
    import gc

    import torch

    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() / 2**20


@pytest.mark.parametrize(("backend", "name"), CASES)
def test_an_unread_stream_holds_nothing_and_close_mid_stream_is_safe(fixtures, backend: str, name: str) -> None:
    from exllama_integrations import ExLlamaRuntime

    before = _gpu_mb()
    rt = (
        ExLlamaRuntime(fixtures[name], backend, cache_size=8192)
        if backend == "exllamav3"
        else ExLlamaRuntime(fixtures[name], backend)
    )
    unread = rt.stream(PROMPT, temperature=0, max_new_tokens=300, ignore_eos=True)
    next(unread)  # shown one token, then nobody reads
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(rt.generate, PROMPT, temperature=0, max_new_tokens=4).result(timeout=120)
    assert other.usage.completion_tokens == 4
    assert rt.generate(PROMPT, temperature=0, max_new_tokens=4).usage.completion_tokens == 4  # same thread
    reading = rt.stream(PROMPT, temperature=0, max_new_tokens=300, ignore_eos=True)
    next(reading)
    batch = rt.model_info().max_batch_size
    t0 = time.perf_counter()
    rt.close()  # while two generations are in flight
    took = time.perf_counter() - t0
    ends = [list(s)[-1].finish_reason for s in (unread, reading)]
    after = _gpu_mb()
    print(
        f"{backend}/{name}: close() mid-stream took {took:.3f}s; streams ended {ends}; "
        f"GPU memory {before:.0f} -> {after:.0f} MiB"
    )
    # one-at-a-time backends (v1, v2) run the unread request to its end before the next one: it ends
    # "length" when it is that short; a request being read is always cancelled
    unread_may_end = ("cancelled",) if batch > 1 else ("cancelled", "length")
    assert took < 30 and ends[0] in unread_may_end and ends[1] == "cancelled"
    assert after - before < 64, "close() left the model or cache allocated"


@pytest.mark.parametrize("backend", ["exllamav3", "exllama", "exllamav2"])
def test_absurd_configs_are_refused_before_the_backend_loads(fixtures, tmp_path: Path, backend: str) -> None:
    from exllama_integrations import ExLlamaRuntime, InvalidModelError

    src = fixtures["gptq" if backend == "exllama" else "fp16-gqa"]
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["num_hidden_layers"] = 10**9
    (bad / "config.json").write_text(json.dumps(cfg))
    t0 = time.perf_counter()
    with pytest.raises(InvalidModelError, match="num_hidden_layers"):
        ExLlamaRuntime(bad, backend)
    assert time.perf_counter() - t0 < 10


def _decode_logits(rt, prompt_ids: list[int], tokens: list[int]):
    """The backend's logits at each decode step, fed the oracle's tokens (teacher forcing) where it can be."""
    import torch

    lib = rt.diagnostics()
    if rt.backend_name == "exllamav3":
        # exllamav3 decodes its own greedy tokens; its logits are compared while they agree with the oracle's
        from exllamav3 import ComboSampler, Job

        gen = lib["generator"]
        job = Job(
            input_ids=torch.tensor([prompt_ids]),
            max_new_tokens=len(tokens),
            sampler=ComboSampler(temperature=0),
            return_logits=True,
            stop_conditions=[],
        )
        gen.enqueue(job)
        steps, got = [], []
        while gen.num_remaining_jobs():
            for r in gen.iterate():
                if r.get("stage") == "streaming":
                    if r.get("logits") is not None:
                        steps.extend(r["logits"][0].float().cpu())
                    if r.get("token_ids") is not None:
                        got.extend(r["token_ids"].flatten().tolist())
        return torch.stack(steps), got
    session = lib["open_session"]()
    with torch.inference_mode():
        out = [session.prefill(prompt_ids)[0].float().cpu()]
        for t in tokens[:-1]:
            out.append(session.step(t)[0].float().cpu())
    session.close()
    return torch.stack(out), tokens


@pytest.mark.parametrize(("backend", "name"), CASES)
def test_decode_steps_match_the_oracle_step_by_step(fixtures, backend: str, name: str) -> None:
    import torch

    from exllama_integrations import ExLlamaRuntime

    oracle = ExLlamaRuntime(_oracle_dir(fixtures, name), "transformers", device="cuda", dtype="float32")
    ids = oracle.encode(PROMPT, add_special_tokens=True)
    want = list(oracle.generate(ids, temperature=0, max_new_tokens=STEPS, ignore_eos=True).token_ids)
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(_oracle_dir(fixtures, name)), dtype=torch.float32).cuda().eval()
    with torch.inference_mode():
        ref = m(torch.tensor([ids + want], device="cuda")).logits[0, len(ids) - 1 : -1].float().cpu()
    del m
    oracle.close()
    torch.cuda.empty_cache()
    opts = {"cache_size": 4096} if backend == "exllamav3" else {}
    rt = ExLlamaRuntime(fixtures[name], backend, **opts)
    try:
        logits, got = _decode_logits(rt, ids, want)
    finally:
        rt.close()
    agree = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
    n = min(agree + 1, len(logits), STEPS)  # steps fed the same tokens as the oracle
    diffs = (logits[:n, : ref.shape[1]] - ref[:n]).abs().amax(dim=-1)
    tol = 0.05 * ref.std().item()
    worst = int(diffs.argmax())
    print(
        f"{backend}/{name}: decode steps compared {n}/{STEPS}, worst step {worst} max logit diff "
        f"{diffs[worst]:.4f} (tolerance {tol:.4f}); tokens agree for {agree}"
    )
    assert diffs.max().item() <= tol
    assert n >= 16, f"only {n} decode steps could be compared"
