"""Decision questions on exllamav3 against the transformers oracle (fp32 on the same GPU), and batch invariance.

exllamav3 scores labels on borrowed pages of its generator's cache (``backends/exllamav3/decisions.py``, the forwards
``decision_plan.plan`` lays out): the prefix's full pages once per request, each question's prompt chunked by pages
from position 0 after them, its labels' rest fused into its last chunk's forward where they are few and small, else
rows of forwards of their own; the oracle is the CPU reference backend's scorer on CUDA in float32, which
tests/integration/test_decisions.py checks against transformers' own forward. The prompts must be the same text, the
probabilities close (fp16 weights against fp32), the paged path close to the cache-free one on the same model (a
prefix over a page, more labels than a forward's rows; a question under a page, one forward), the forwards run the
plan's, every borrowed page given back, and exllamav3's answer the same alone, beside other questions and inside a
burst of generations and other decisions.

Run on the lent GPU: ``pytest -m gpu tests/gpu/test_gpu_decisions.py``. Skipped without CUDA.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

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


LONG_STATE = " ".join(f"line {i}: the fox ran past tree {i * 7} near the river." for i in range(40))
"""A state of more than one page (256 tokens): the prefix is read in two forwards, the labels start mid-page."""


def _many_labels():
    from exllama_integrations.contract.decisions import Choice, Label

    names = [
        f"the {w} place number {i}"
        for i, w in enumerate("north south east west upper lower inner outer old new".split())
    ]
    return (Choice("place", "Which place does it go to?", tuple(Label(n) for n in names)),)  # 10, several tokens each


@contextmanager
def _forwards(model: Any) -> Iterator[list[int]]:
    """Counts ``model.forward`` calls meanwhile (the seam's wrap of it, where there is one, is put back)."""
    own, inner, calls = vars(model).get("forward"), model.forward, [0]

    def forward(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return inner(*args, **kwargs)

    model.forward = forward
    try:
        yield calls
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own


@pytest.mark.parametrize("name", ["fp16-gqa", "fp16-mha", "fp16-pad"])
@pytest.mark.parametrize("state", ["short", "long"])
def test_exllamav3_label_probabilities_match_the_transformers_oracle(fixtures, name, state) -> None:
    from exllama_integrations import ExLlamaRuntime
    from exllama_integrations.contract.decisions import DecisionRequest
    from exllama_integrations.runtime.decisions import decider

    request = DecisionRequest(STATE, _questions()) if state == "short" else DecisionRequest(LONG_STATE, _many_labels())
    oracle = ExLlamaRuntime(_oracle_dir(fixtures, name), "transformers", device="cuda", dtype="float32")
    want = decider(oracle).decide(request)
    oracle.close()
    rt = ExLlamaRuntime(fixtures[name], "exllamav3", cache_size=8192)
    try:
        got = decider(rt).decide(request)
        assert got.prompts == want.prompts and got.prefix_tokens == want.prefix_tokens
        assert max(abs(a - b) for a, b in zip(_flat(got), _flat(want))) < TOLERANCE
        assert decider(rt).decide(request).answers == got.answers  # bitwise, twice
    finally:
        rt.close()


def test_the_paged_path_agrees_with_the_cache_free_one_and_gives_its_pages_back(fixtures) -> None:
    import math

    import torch

    from exllama_integrations import ExLlamaRuntime
    from exllama_integrations.backends.exllamav3 import decisions
    from exllama_integrations.contract.decisions import DecisionRequest, LabelBranch, LabelScoring
    from exllama_integrations.runtime.decisions import decider

    rt = ExLlamaRuntime(fixtures["fp16-gqa"], "exllamav3", cache_size=8192)
    try:
        generator = rt.diagnostics()["generator"]
        free = generator.pagetable.num_unreferenced_pages()
        plan = decider(rt).plan(DecisionRequest(LONG_STATE, _questions() + _many_labels()))
        (job,) = plan.jobs
        assert len(job.prefix) > 256 and sum(len(lab) > 1 for lab in job.branches[-1].labels) > decisions.LABEL_ROWS
        # the benchmark's one Choice on SmolLM2: 60 prefix tokens, 30 of its own, labels of 2, 1 and 2 tokens
        short = LabelScoring(tuple(range(100, 160)), (LabelBranch(tuple(range(200, 230)), ((5, 6), (7,), (8, 9))),))
        assert decisions.forwards_needed(short) == 1
        for j in (job, short):
            with torch.inference_mode():  # as the runtime's driver calls them (its step context)
                with _forwards(generator.model) as calls:
                    paged = decisions.score_labels_paged(generator, j)
                assert calls[0] == decisions.forwards_needed(j)  # the plan's forwards, no more
                nc = decisions.score_labels_nc(generator.model, j)
            for p_row, n_row in zip(paged, nc):
                p = [math.exp(x) for x in p_row]
                n = [math.exp(x) for x in n_row]
                assert max(abs(a - b) for a, b in zip(p, n)) < TOLERANCE, (p_row, n_row)
        assert generator.pagetable.num_unreferenced_pages() == free  # every borrowed page given back
        assert rt.generate(STATE, max_new_tokens=8, temperature=0).text is not None  # the cache still serves
    finally:
        rt.close()


def test_exllamav3_decisions_are_the_same_alone_and_in_a_burst(fixtures) -> None:
    import time

    from exllama_integrations import ExLlamaRuntime
    from exllama_integrations.contract.decisions import DecisionRequest
    from exllama_integrations.runtime.decisions import decider

    request = DecisionRequest(STATE, _questions())
    rt = ExLlamaRuntime(fixtures["fp16-gqa"], "exllamav3", cache_size=16384)
    try:
        alone = decider(rt).decide(request)
        beside = decider(rt).decide(DecisionRequest(STATE, _questions() + _many_labels()))
        assert _flat(beside)[: len(_flat(alone))] == _flat(alone)  # beside other questions: the same forwards
        burst: list = []
        gens = [
            threading.Thread(
                target=rt.generate, args=(f"{STATE} {i}",), kwargs={"max_new_tokens": 96, "temperature": 0}
            )
            for i in range(8)
        ]
        others = [
            threading.Thread(target=decider(rt).decide, args=(DecisionRequest(f"{LONG_STATE} {i}", _many_labels()),))
            for i in range(4)
        ]
        for t in gens:
            t.start()
        time.sleep(0.5)  # the generations are decoding
        for t in others:
            t.start()
        burst.append(decider(rt).decide(request))
        for t in gens + others:
            t.join(300)
        assert max(abs(a - b) for a, b in zip(_flat(burst[0]), _flat(alone))) < 1e-6
    finally:
        rt.close()
