"""Decision questions on exllamav3 against the transformers oracle (fp32 on the same GPU), and batch invariance.

exllamav3 scores labels with its cache-free one-row forward on the driver's thread
(``backends/exllamav3/decisions.py``); the oracle is the CPU reference backend's scorer on CUDA in float32, which
tests/integration/test_decisions.py checks against transformers' own forward. The prompts must be the same text,
the probabilities close (fp16 weights against fp32), and exllamav3's answer the same alone and beside generations.

Run on the lent GPU: ``pytest -m gpu tests/gpu/test_gpu_decisions.py``. Skipped without CUDA.
"""

from __future__ import annotations

import threading

import pytest
from test_gpu_backends import _oracle_dir

pytestmark = pytest.mark.gpu
STATE = "the quick brown fox jumps over the lazy dog and then runs into the forest"
TOLERANCE = 0.02
"""Largest difference of one probability: the weights are fp16 on exllamav3, fp32 in the oracle."""


def _questions():
    from exllama_integrations.contract.decisions import Choice, Label, Noul, Score, labels

    return (
        Noul("fox", "Is there a fox?"),
        Choice("where", "Where does it go?", (Label("forest"), Label("river bank"), Label("the old town hall"))),
        Score("speed", "How fast is it?", labels("slow", "steady", "fast")),
    )


def _flat(result) -> list[float]:
    out: list[float] = []
    for a in result.answers:
        if hasattr(a, "probability"):
            out.append(a.probability)
        else:
            out.extend(p if isinstance(p, float) else p[1] for p in a.probabilities)
    return out


def test_exllamav3_label_probabilities_match_the_transformers_oracle(fixtures) -> None:
    from exllama_integrations import ExLlamaRuntime
    from exllama_integrations.contract.decisions import DecisionRequest
    from exllama_integrations.runtime.decisions import decider

    request = DecisionRequest(STATE, _questions())
    oracle = ExLlamaRuntime(_oracle_dir(fixtures, "fp16-gqa"), "transformers", device="cuda", dtype="float32")
    want = decider(oracle).decide(request)
    oracle.close()
    rt = ExLlamaRuntime(fixtures["fp16-gqa"], "exllamav3", cache_size=8192)
    try:
        got = decider(rt).decide(request)
        assert got.prompts == want.prompts
        assert max(abs(a - b) for a, b in zip(_flat(got), _flat(want))) < TOLERANCE
        assert decider(rt).decide(request).answers == got.answers  # bitwise, twice
        burst: list = []
        gens = [
            threading.Thread(target=rt.generate, args=(STATE,), kwargs={"max_new_tokens": 64, "temperature": 0})
            for _ in range(6)
        ]
        for t in gens:
            t.start()
        burst.append(decider(rt).decide(request))
        for t in gens:
            t.join(120)
        assert max(abs(a - b) for a, b in zip(_flat(burst[0]), _flat(got))) < 1e-6
    finally:
        rt.close()
