"""exllamav3's cache_size="auto": the arithmetic, checked without a GPU (the GPU test loads it for real)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from exllama_integrations.backends.exllamav3.options import (
    PAGE,
    RESERVE,
    ExLlamaV3Options,
    auto_cache_tokens,
    cache_bytes_per_token,
)

GIB = 2**30
LLAMA2_7B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_size": 4096}


def test_bytes_per_token_is_k_and_v_of_every_layer():
    assert cache_bytes_per_token(LLAMA2_7B, None) == 32 * 32 * 128 * 2 * 2  # 0.5 MiB in fp16
    assert cache_bytes_per_token(LLAMA2_7B, 8) == 32 * 32 * 128 * 2
    assert cache_bytes_per_token(LLAMA2_7B, (8, 4)) == 32 * 32 * 128 * 1.5
    gqa = {**LLAMA2_7B, "num_key_value_heads": 8}
    assert cache_bytes_per_token(gqa, None) == cache_bytes_per_token(LLAMA2_7B, None) / 4


@pytest.fixture()
def gpu(monkeypatch):
    import torch

    state = {"free": 100 * GIB}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=0: (state["free"], 141 * GIB))
    return state


def _model(weights: int):
    file = SimpleNamespace(stat=lambda: SimpleNamespace(st_size=weights))
    return SimpleNamespace(config=LLAMA2_7B, text_config=LLAMA2_7B, weight_files=[file])


def test_auto_takes_the_free_memory_left_after_the_weights(gpu):
    tokens, why = auto_cache_tokens(_model(13 * GIB), ExLlamaV3Options(), context=4096)
    expect = int((100 * GIB * 0.9 - 13 * GIB - RESERVE) // (0.5 * 2**20)) // PAGE * PAGE
    assert tokens == expect and why["limited_by"] == "memory" and tokens % PAGE == 0
    assert tokens == 149_504  # 90 - 13 - 4 = 73 GiB at 0.5 MiB a token (64 jobs x 4096 would need 128 GiB)


def test_auto_stops_at_what_max_batch_size_jobs_can_use(gpu):
    tokens, why = auto_cache_tokens(_model(13 * GIB), ExLlamaV3Options(max_batch_size=8), context=4096)
    assert tokens == 8 * 4096 and why["limited_by"] == "max_batch_size x context"


def test_auto_on_a_full_gpu_still_gives_one_page(gpu):
    gpu["free"] = 2 * GIB
    tokens, _ = auto_cache_tokens(_model(13 * GIB), ExLlamaV3Options(), context=4096)
    assert tokens == PAGE


def test_runtimes_sharing_a_gpu_each_plan_within_their_share_not_the_free_memory(gpu):
    """Two engines (or two Ray replicas at num_gpus=0.5) load at once: each sees all the free memory."""
    from exllama_integrations.backends.base import build_options
    from exllama_integrations.runtime.engine.backend import shared_options

    gpu["free"] = 140 * GIB
    alone, _ = auto_cache_tokens(_model(13 * GIB), ExLlamaV3Options(max_batch_size=1024), context=4096)
    two = shared_options(ExLlamaV3Options(max_batch_size=1024), 1 / 2)
    assert two.memory_share == 0.5
    half, why = auto_cache_tokens(_model(13 * GIB), two, context=4096)
    assert why["memory_share"] == 0.5
    assert half == int((70.5 * GIB * 0.9 - 13 * GIB - RESERVE) // (0.5 * 2**20)) // PAGE * PAGE
    per_token = 0.5 * 2**20
    assert 2 * (13 * GIB + RESERVE + half * per_token) <= 141 * GIB * 0.9 < 2 * (13 * GIB + alone * per_token)
    given = build_options(ExLlamaV3Options, "exllamav3", {"memory_share": 0.7})
    assert shared_options(given, 1 / 2).memory_share == 0.7  # a share the user named is kept
    assert shared_options(ExLlamaV3Options(), 0.25).memory_share == 0.25  # a fractional replica
    assert shared_options(ExLlamaV3Options(), 1.0).memory_share == 1.0


def test_cache_size_takes_auto_or_pages():
    from exllama_integrations import InvalidSettingsError
    from exllama_integrations.backends.base import build_options

    assert build_options(ExLlamaV3Options, "exllamav3", {}).cache_size == "auto"
    assert build_options(ExLlamaV3Options, "exllamav3", {"cache_bits": [8, 4]}).cache_bits == (8, 4)
    for bad in ({"cache_size": 100}, {"cache_size": "big"}, {"cache_bits": (9, 4)}, {"cache_memory": 1.5}):
        with pytest.raises(InvalidSettingsError):
            build_options(ExLlamaV3Options, "exllamav3", bad)
    with pytest.raises(InvalidSettingsError, match="did you mean 'cache_bits'"):
        build_options(ExLlamaV3Options, "exllamav3", {"cache_bit": 8})
