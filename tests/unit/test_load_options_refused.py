"""Load options that would be accepted and then never read are refused, typed, saying what to set instead."""

from __future__ import annotations

import pytest

from exllama_integrations import InvalidSettingsError
from exllama_integrations.backends.base import build_options
from exllama_integrations.backends.exllamav3.options import ExLlamaV3Options, generator_kwargs


def test_batched_prefill_needs_the_fast_decode_path():
    with pytest.raises(InvalidSettingsError, match="prefill='batched' runs inside the fast decode path"):
        build_options(ExLlamaV3Options, "exllamav3", {"prefill": "batched", "decode": "exllamav3"})
    opts = build_options(ExLlamaV3Options, "exllamav3", {"prefill": "batched"})  # decode="fast", the default
    assert isinstance(opts, ExLlamaV3Options) and opts.prefill == "batched"


def test_a_disk_cache_needs_the_host_memory_tier_in_front_of_it(tmp_path):
    with pytest.raises(InvalidSettingsError, match="disk_cache_dir is the tier behind cpu_cache_size"):
        build_options(ExLlamaV3Options, "exllamav3", {"disk_cache_dir": str(tmp_path)})
    opts = build_options(ExLlamaV3Options, "exllamav3", {"disk_cache_dir": str(tmp_path), "cpu_cache_size": 2**30})
    assert isinstance(opts, ExLlamaV3Options)
    kw = generator_kwargs(opts, 2048)  # what exllamav3's Generator is given: both tiers
    assert kw["cpu_cache_size"] == 2**30 and kw["disk_cache_dir"] == str(tmp_path)
