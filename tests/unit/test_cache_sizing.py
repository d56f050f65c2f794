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
