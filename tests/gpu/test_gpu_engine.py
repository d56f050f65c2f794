"""exllamav3 in an engine process (``engine="process"``, ``engines=2``) on the GPU: the same tokens as in a thread,
a killed engine's GPU memory returned and its streams ended typed, two engines sharing one GPU.

Run on the lent GPU: ``pytest -m gpu tests/gpu``. Skipped without CUDA.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from fixture_models import SMALL_GQA, make_llama

pytestmark = pytest.mark.gpu
PROMPT = "the quick brown fox jumps over the lazy dog and then"


def smi() -> int:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True
    ).stdout
    return int(out.split()[0])


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama(tmp_path_factory.mktemp("engine") / "fp16", SMALL_GQA, seed=21)


def test_the_engine_process_decodes_the_tokens_of_the_thread(model: Path) -> None:
    from exllama_integrations import ExLlamaRuntime, GenerationSettings, Grammar

    greedy = GenerationSettings(max_new_tokens=32, temperature=0)
    with ExLlamaRuntime(model, "exllamav3", cache_size=8192) as local:
        ref = [local.generate(f"{PROMPT} {i}", settings=greedy) for i in range(4)]
        schema = Grammar.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
        ref_json = local.generate(PROMPT, settings=greedy, grammar=schema)
    with ExLlamaRuntime(model, "exllamav3", cache_size=8192, engine="process") as remote:
        assert remote.model_info().details["engine"] == "process"
        got = remote.batch([f"{PROMPT} {i}" for i in range(4)], settings=greedy)
        assert [g.token_ids for g in got] == [r.token_ids for r in ref]
        got_json = remote.generate(PROMPT, settings=greedy, grammar=schema)
        assert got_json.text == ref_json.text and got_json.constraint_complete == ref_json.constraint_complete
        print(f"engine process: 4 greedy streams identical to the thread's; JSON {got_json.text!r}")


def test_a_killed_engine_ends_its_streams_typed_returns_its_memory_and_starts_again(model: Path) -> None:
    from exllama_integrations import EngineUnavailableError, ExLlamaRuntime, GenerationSettings

    base = smi()
    rt = ExLlamaRuntime(model, "exllamav3", cache_size=8192, engine="process")
    try:
        loaded = smi()
        streams = [
            rt.stream(f"{PROMPT} {i}", settings=GenerationSettings(max_new_tokens=4000, ignore_eos=True))
            for i in range(8)
        ]
        errors: list[BaseException] = []
        ended: list[float] = []

        def read(s) -> None:  # noqa: ANN001
            try:
                for _ in s:
                    pass
            except EngineUnavailableError as e:
                errors.append(e)
            ended.append(time.perf_counter())

        readers = [threading.Thread(target=read, args=(s,)) for s in streams]
        for t in readers:
            t.start()
        time.sleep(1.0)
        killed = time.perf_counter()
        os.kill(rt.diagnostics()["engine_pids"][0], signal.SIGKILL)
        for t in readers:
            t.join(10)
        assert len(errors) == 8 and max(ended) - killed < 5
        t0 = time.perf_counter()
        while rt.health() is not None and time.perf_counter() - t0 < 120:
            time.sleep(0.2)
        assert rt.health() is None
        after = rt.generate(PROMPT, settings=GenerationSettings(max_new_tokens=8, temperature=0))
        assert after.usage.completion_tokens == 8
        print(
            f"killed mid-stream: 8 streams ended typed in {max(ended) - killed:.2f} s; GPU {base} -> {loaded} MiB "
            f"loaded, {smi()} MiB after the restart (the dead engine's memory returned)"
        )
        assert smi() <= loaded + 256
    finally:
        rt.close()
    time.sleep(1)
    assert smi() <= base + 256


def test_two_engines_on_one_gpu_share_the_load(model: Path) -> None:
    from exllama_integrations import ExLlamaRuntime, GenerationSettings

    with ExLlamaRuntime(model, "exllamav3", cache_size=8192, engines=2) as rt:
        engines = rt.diagnostics()["engines"]
        streams = [
            rt.stream(f"{PROMPT} {i}", settings=GenerationSettings(max_new_tokens=200, ignore_eos=True))
            for i in range(8)
        ]
        for s in streams:
            next(iter(s))
        loads = [e.load for e in engines]
        for s in streams:
            s.close()
        print(f"two engines on one GPU: loads {loads} for 8 streams")
        assert loads == [4, 4]


def test_warmup_at_load_is_reported_and_changes_no_token(model: Path) -> None:
    from exllama_integrations import ExLlamaRuntime, GenerationSettings

    greedy = GenerationSettings(max_new_tokens=24, temperature=0)
    prompts = [f"{PROMPT} {i}" for i in range(4)]
    t0 = time.perf_counter()
    with ExLlamaRuntime(model, "exllamav3", cache_size=8192, warmup=False) as cold:
        load_cold = time.perf_counter() - t0
        assert "warmup_seconds" not in cold.model_info().details
        ref = [r.token_ids for r in cold.batch(prompts, settings=greedy)]
    t0 = time.perf_counter()
    with ExLlamaRuntime(model, "exllamav3", cache_size=8192, warmup=True) as warm:
        load_warm = time.perf_counter() - t0
        details = warm.model_info().details
        assert details["warmup_seconds"] >= 0 and "warmup_failed" not in details
        got = [r.token_ids for r in warm.batch(prompts, settings=greedy)]
    print(f"warmup: {details['warmup_seconds']} s at load (load {load_cold:.1f} s without, {load_warm:.1f} s with)")
    assert got == ref  # the passes wrote the cache's leading pages before the generator took it: no trace left
