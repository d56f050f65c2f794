"""Fixtures the retrieval test files share: MiniLM as an embedder, a cross-encoder beside it, a server of each."""

from __future__ import annotations

import pytest
from retrieval_models import make_cross_encoder


@pytest.fixture(scope="module")
def embed_rt(minilm_dir):
    from exllama_integrations.runtime.local import EmbeddingRuntime

    return EmbeddingRuntime.shared(minilm_dir)


@pytest.fixture(scope="module")
def rerank_rt(tmp_path_factory, minilm_dir):
    from exllama_integrations.runtime.local import EmbeddingRuntime

    rt = EmbeddingRuntime(make_cross_encoder(tmp_path_factory.mktemp("cross") / "cross", minilm_dir))
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def servers(embed_rt, rerank_rt):
    from servers import ThreadServer

    embed, rerank = ThreadServer(embed_rt), ThreadServer(rerank_rt)
    yield {"embed": embed.url, "rerank": rerank.url}
    embed.stop()
    rerank.stop()
