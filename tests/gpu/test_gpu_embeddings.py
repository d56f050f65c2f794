"""Decoder embedding and yes/no rerank models on exllamav3 against the transformers fp32 oracle (same weights).

A Qwen3 at a realistic width (``arch_models``' ``size="gpu"``: hidden 1024, 8 layers, bf16 weights) with
Qwen3-Embedding's sentence-transformers files (last-token pooling, Normalize, a query prompt), built on the GPU.
exllamav3 pools the final norm's state its forward exports; the oracle is the transformers backend in fp32 on
the same directory. Rule: cosine >= 0.999 per vector (exllamav3 computes in fp16), the same vector for an input
alone and in a padded batch, and yes/no relevance within 0.01 of the oracle's, in the same order.

Run on the GPU machine: ``python3 -m pytest -m gpu tests/gpu/test_gpu_embeddings.py -v -s``.
"""

from __future__ import annotations

import numpy as np
import pytest

from exllama_integrations.contract.retrieval import EmbeddingRequest, RerankRequest
from exllama_integrations.runtime.local import EmbeddingRuntime

pytestmark = pytest.mark.gpu

TEXTS = [
    "the cat sat on the mat",
    "a",
    "reading the final norm state of every position, then the last real token of each row",  # (within 128 tokens)
    "short one",
    "where is the station",
]


@pytest.fixture(scope="module")
def embedder_dir(tmp_path_factory):
    from retrieval_models import make_decoder_embedder

    return make_decoder_embedder(tmp_path_factory.mktemp("emb") / "qwen3-embed", seed=11, size="gpu", device="cuda")


def _cos(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_decoder_embeddings_on_exllamav3_match_the_oracle(embedder_dir):
    with EmbeddingRuntime(embedder_dir, "transformers", device="cuda", dtype="float32") as oracle:
        want_q = oracle.embed(EmbeddingRequest(TEXTS, input_type="query")).vectors
        want_d = oracle.embed(EmbeddingRequest(TEXTS, input_type="document")).vectors
    with EmbeddingRuntime(embedder_dir, "exllamav3") as rt:
        info = rt.embedding_info()
        assert (info.backend, info.pooling, info.dimensions) == ("exllamav3", "lasttoken", 1024)
        got_q = rt.embed(EmbeddingRequest(TEXTS, input_type="query")).vectors
        got_d = rt.embed(EmbeddingRequest(TEXTS, input_type="document")).vectors
        alone = [rt.embed(EmbeddingRequest([t], input_type="document")).vectors[0] for t in TEXTS]
    worst = min(_cos(got_q, want_q).min(), _cos(got_d, want_d).min())
    print(f"exllamav3 vs oracle: worst cosine {worst:.6f} over {2 * len(TEXTS)} vectors")
    assert worst >= 0.999
    assert _cos(alone, got_d).min() >= 0.9999  # padding in a batch changes nothing
    assert np.allclose(np.linalg.norm(got_d, axis=1), 1.0, atol=1e-3)


def test_yes_no_reranking_on_exllamav3_matches_the_oracle(tmp_path):
    from arch_models import make_arch
    from retrieval_models import with_yes_no

    path = with_yes_no(make_arch("qwen3", tmp_path / "qwen3-rerank", size="gpu", seed=12, device="cuda"))
    request = RerankRequest("where is the station", TEXTS)
    with EmbeddingRuntime(path, "transformers", kind="rerank", device="cuda", dtype="float32") as oracle:
        want = oracle.rerank(request).hits
    with EmbeddingRuntime(path, "exllamav3", kind="rerank") as rt:
        got = rt.rerank(request).hits
    by_index = {h.index: h.score for h in got}
    diff = max(abs(by_index[h.index] - h.score) for h in want)
    print(f"exllamav3 yes/no relevance vs oracle: max difference {diff:.5f}")
    assert diff <= 0.01
    spread = [h.score for h in want]
    if min(abs(a - b) for a, b in zip(spread, spread[1:])) > 0.02:  # an order decided by more than the rounding
        assert [h.index for h in got] == [h.index for h in want]
