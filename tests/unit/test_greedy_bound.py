"""A temperature below a tiny bound is greedy on every backend's sampler (issue 34, item 6)."""

from __future__ import annotations

import pytest

from exllama_integrations import GenerationSettings
from exllama_integrations.backends.exllamav3.fast.sampler import row_settings
from exllama_integrations.backends.logits import GREEDY_BELOW, is_greedy


@pytest.mark.parametrize("t", [0.0, 1e-300, 1e-40, GREEDY_BELOW / 2])
def test_a_temperature_below_the_bound_is_greedy_for_every_sampler(t):
    s = GenerationSettings(temperature=t)
    assert is_greedy(s) and row_settings(s).greedy  # the CPU reference and v1/v2; exllamav3's fast decode


@pytest.mark.parametrize("t", [GREEDY_BELOW, 0.01, 0.7])
def test_a_temperature_at_or_over_the_bound_samples(t):
    s = GenerationSettings(temperature=t)
    assert not is_greedy(s) and not row_settings(s).greedy
