"""What embedding and rerank clients trip on, against the real all-MiniLM-L6-v2 (and a BERT cross-encoder).

* LangChain's default ``OpenAIEmbeddings`` sends tiktoken's token ids, not text: the server answers a typed 400
  that names the fix (``check_embedding_ctx_length=False``), and with it the vectors are the model's own. Token ids
  past the vocabulary (or 2**70) are that 400 too, never a 500 that drops the keep-alive connection.
* A lone surrogate in a text, in this process, is a typed error, not the tokenizer's raw ``TypeError``.
* More inputs than one request carries (2048): the LangChain and LlamaIndex classes, in this process and over
  ``base_url=``, send several requests (``InMemoryVectorStore.from_texts`` with 2,049 texts), and the rerank classes
  merge the rankings of several requests.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from exllama_integrations.contract.retrieval import MAX_INPUTS, EmbeddingRequest, RerankRequest
from exllama_integrations.errors import InvalidSettingsError

QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital and largest city of France.", "Photosynthesis turns light into chemical energy."]
MANY = [f"note {i} of the archive" for i in range(MAX_INPUTS + 1)]


def _tiktoken_offline(monkeypatch) -> None:
    """tiktoken's cl100k_base from the copy llama-index-core ships (no network here)."""
    import llama_index.core

    cache = Path(llama_index.core.__file__).parent / "_static" / "tiktoken_cache"
    assert any(cache.iterdir())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))


def test_langchains_default_openai_embeddings_gets_a_400_naming_the_fix(servers, embed_rt, monkeypatch):
    import openai
    from langchain_openai import OpenAIEmbeddings

    _tiktoken_offline(monkeypatch)
    default = OpenAIEmbeddings(base_url=servers["embed"] + "/v1", api_key="unused", model="all-MiniLM-L6-v2")
    with pytest.raises(openai.BadRequestError) as e:
        default.embed_documents(DOCS)  # tiktoken's ids, past MiniLM's 30,522 tokens
    assert e.value.body["code"] == "token_id_out_of_range" and e.value.body["param"] == "input"
    assert "check_embedding_ctx_length=False" in e.value.body["message"]
    # what docs/embeddings.md shows
    emb = OpenAIEmbeddings(
        base_url=servers["embed"] + "/v1", api_key="unused", model="all-MiniLM-L6-v2", check_embedding_ctx_length=False
    )
    want = embed_rt.embed(EmbeddingRequest(DOCS)).vectors
    assert np.allclose(emb.embed_documents(DOCS), want, atol=1e-5)


@pytest.mark.parametrize("ids", [[101, 30522, 102], [101, 2**70, 102]], ids=["vocabulary", "2**70"])
def test_token_ids_past_the_vocabulary_are_a_400_on_a_kept_connection(servers, ids):
    with httpx.Client(base_url=servers["embed"], timeout=30) as client:
        r = client.post("/v1/embeddings", json={"input": [ids]})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "token_id_out_of_range" and r.headers.get("connection") != "close"
        assert "30522 tokens" in r.json()["error"]["message"]
        assert client.post("/v1/embeddings", json={"input": [[101, 7592, 102]]}).status_code == 200


def test_a_lone_surrogate_in_process_is_a_typed_error(minilm_dir, rerank_rt):
    from exllama_integrations.langchain import ExLlamaEmbeddings

    emb = ExLlamaEmbeddings(model_dir=str(minilm_dir))
    with pytest.raises(InvalidSettingsError, match="lone surrogate"):
        emb.embed_documents(["fine", "broken \ud800 text"])
    with pytest.raises(InvalidSettingsError, match="lone surrogate"):
        emb.embed_query("\udc00")
    with pytest.raises(InvalidSettingsError, match="lone surrogate"):
        rerank_rt.rerank(RerankRequest(QUERY, ["a", "b\udfff"]))


@pytest.fixture(scope="module", params=["local", "remote"])
def place(request, servers, minilm_dir, rerank_rt):
    if request.param == "local":
        return {"embed": {"model_dir": str(minilm_dir)}, "rerank": {"runtime": rerank_rt}}
    return {"embed": {"base_url": servers["embed"]}, "rerank": {"base_url": servers["rerank"]}}


def _want(embed_rt, texts):
    return embed_rt.embed(EmbeddingRequest(texts, input_type="document")).vectors  # alone or in a batch: the same


def _best(rerank_rt, query, docs, n):
    scores = {}
    for start in range(0, len(docs), MAX_INPUTS):
        for h in rerank_rt.rerank(RerankRequest(query, docs[start : start + MAX_INPUTS])).hits:
            scores[start + h.index] = h.score
    return sorted(scores, key=lambda i: (-scores[i], i))[:n], scores


def test_langchain_classes_send_more_than_one_request_carries(place, embed_rt, rerank_rt):
    from langchain_core.documents import Document
    from langchain_core.vectorstores import InMemoryVectorStore

    from exllama_integrations.langchain import ExLlamaEmbeddings, ExLlamaRerank

    emb = ExLlamaEmbeddings(**place["embed"])
    texts = [*MANY[:-1], DOCS[0]]  # 2,049 texts, the answer last
    store = InMemoryVectorStore.from_texts(texts, emb)
    assert len(store.store) == MAX_INPUTS + 1
    assert store.similarity_search(QUERY, k=1)[0].page_content == DOCS[0]
    kept_vectors = [store.store[k]["vector"] for k in list(store.store)[-2:]]
    assert np.allclose(kept_vectors, _want(embed_rt, texts[-2:]), atol=1e-5)

    order, scores = _best(rerank_rt, QUERY, MANY, 3)
    kept = ExLlamaRerank(top_n=3, **place["rerank"]).compress_documents(
        [Document(page_content=d, metadata={"i": i}) for i, d in enumerate(MANY)], QUERY
    )
    assert [d.metadata["i"] for d in kept] == order
    assert [d.metadata["relevance_score"] for d in kept] == pytest.approx([scores[i] for i in order], abs=1e-6)


async def test_llama_index_classes_send_more_than_one_request_carries(place, embed_rt, rerank_rt):
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

    from exllama_integrations.llama_index import ExLlamaEmbedding, ExLlamaRerank

    emb = ExLlamaEmbedding(embed_batch_size=4096, **place["embed"])  # the default, 64, stays under the limit
    vectors = await emb.aget_text_embedding_batch(MANY)
    assert len(vectors) == MAX_INPUTS + 1
    assert np.allclose([vectors[0], vectors[-1]], _want(embed_rt, [MANY[0], MANY[-1]]), atol=1e-5)

    order, _ = _best(rerank_rt, QUERY, MANY, 2)
    nodes = [NodeWithScore(node=TextNode(text=d, id_=str(i))) for i, d in enumerate(MANY)]
    kept = ExLlamaRerank(top_n=2, **place["rerank"]).postprocess_nodes(nodes, QueryBundle(QUERY))
    assert [int(n.node.id_) for n in kept] == order
