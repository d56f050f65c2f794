"""Embeddings and rerank at every door: LangChain, LlamaIndex (in process and through a server) and the HTTP API.

One behaviour, decided once: documents and queries embed with the model's own prompts, the vectors equal the
runtime's (which equal sentence-transformers', tests/integration/test_embeddings.py), rerank keeps the ``top_n``
best with their scores, and a model that does not do the task is refused typed. Each is checked through
LangChain's and LlamaIndex's classes over ``model_dir=`` and ``base_url=``, and through the server with the clients
people use: the openai client's ``embeddings.create`` (float and base64) and Cohere's v1 and v2 clients' rerank.
"""

from __future__ import annotations

import numpy as np
import pytest
from servers import ThreadServer

from exllama_integrations.contract.retrieval import EmbeddingRequest, RerankRequest
from exllama_integrations.errors import UnsupportedTaskError

DOCS = [
    "Paris is the capital and largest city of France.",
    "Photosynthesis turns light into chemical energy in plants.",
    "Python is a programming language created by Guido van Rossum.",
    "The Eiffel Tower is a wrought-iron tower in Paris.",
]
QUERY = "What is the capital of France?"


@pytest.fixture(scope="module", params=["local", "remote"])
def place(request, servers, minilm_dir, rerank_rt):
    if request.param == "local":
        return {"embed": {"model_dir": str(minilm_dir)}, "rerank": {"runtime": rerank_rt}}
    return {"embed": {"base_url": servers["embed"]}, "rerank": {"base_url": servers["rerank"]}}


def _want(rt, texts, input_type):
    return rt.embed(EmbeddingRequest(texts, input_type=input_type)).vectors


def test_langchain_embeddings_and_compressor(place, embed_rt, rerank_rt):
    from langchain_core.documents import Document
    from langchain_core.vectorstores import InMemoryVectorStore

    from exllama_integrations.langchain import ExLlamaEmbeddings, ExLlamaRerank

    emb = ExLlamaEmbeddings(**place["embed"])
    assert np.allclose(emb.embed_documents(DOCS), _want(embed_rt, DOCS, "document"), atol=1e-6)
    assert np.allclose(emb.embed_query(QUERY), _want(embed_rt, [QUERY], "query")[0], atol=1e-6)
    store = InMemoryVectorStore.from_texts(DOCS, emb)
    assert store.similarity_search(QUERY, k=1)[0].page_content == DOCS[0]

    rerank = ExLlamaRerank(top_n=2, **place["rerank"])
    kept = rerank.compress_documents([Document(page_content=d, metadata={"i": i}) for i, d in enumerate(DOCS)], QUERY)
    want = rerank_rt.rerank(RerankRequest(QUERY, DOCS, top_n=2)).hits
    assert [d.metadata["i"] for d in kept] == [h.index for h in want]
    assert [d.metadata["relevance_score"] for d in kept] == pytest.approx([h.score for h in want], abs=1e-6)


async def test_langchain_async_twins(place, embed_rt, rerank_rt):
    from langchain_core.documents import Document

    from exllama_integrations.langchain import ExLlamaEmbeddings, ExLlamaRerank

    emb = ExLlamaEmbeddings(**place["embed"])
    assert np.allclose(await emb.aembed_documents(DOCS), _want(embed_rt, DOCS, "document"), atol=1e-6)
    kept = await ExLlamaRerank(top_n=1, **place["rerank"]).acompress_documents([Document(d) for d in DOCS], QUERY)
    assert kept[0].page_content == DOCS[rerank_rt.rerank(RerankRequest(QUERY, DOCS, top_n=1)).hits[0].index]


def test_llama_index_embedding_and_postprocessor(place, embed_rt, rerank_rt):
    from llama_index.core import VectorStoreIndex
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

    from exllama_integrations.llama_index import ExLlamaEmbedding, ExLlamaRerank

    emb = ExLlamaEmbedding(**place["embed"])
    assert emb.model_name == "all-MiniLM-L6-v2"
    assert np.allclose(emb.get_text_embedding_batch(DOCS), _want(embed_rt, DOCS, "document"), atol=1e-6)
    index = VectorStoreIndex([TextNode(text=d) for d in DOCS], embed_model=emb)
    found = index.as_retriever(similarity_top_k=1).retrieve(QUERY)
    assert found[0].node.get_content() == DOCS[0]

    nodes = [NodeWithScore(node=TextNode(text=d), score=0.0) for d in DOCS]
    kept = ExLlamaRerank(top_n=2, **place["rerank"]).postprocess_nodes(nodes, QueryBundle(QUERY))
    want = rerank_rt.rerank(RerankRequest(QUERY, DOCS, top_n=2)).hits
    assert [n.node.get_content() for n in kept] == [DOCS[h.index] for h in want]
    assert [n.score for n in kept] == pytest.approx([h.score for h in want], abs=1e-6)


def test_a_class_refuses_a_model_that_does_not_do_its_task(place, demo_runtime):
    from exllama_integrations.langchain import ExLlamaEmbeddings, ExLlamaRerank
    from exllama_integrations.llama_index import ExLlamaEmbedding

    with pytest.raises(UnsupportedTaskError, match="is a reranker"):
        ExLlamaEmbeddings(**place["rerank"])
    with pytest.raises(UnsupportedTaskError, match="embedding model"):
        ExLlamaRerank(**place["embed"])
    with pytest.raises(UnsupportedTaskError, match="text-generation model"):
        ExLlamaEmbedding(runtime=demo_runtime)


def test_the_openai_client_embeds(servers, embed_rt):
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=servers["embed"] + "/v1", api_key="unused")
    default = client.embeddings.create(model="all-MiniLM-L6-v2", input=DOCS)  # the client asks for base64
    floats = client.embeddings.create(model="all-MiniLM-L6-v2", input=DOCS[0], encoding_format="float")
    want = _want(embed_rt, DOCS, None)
    assert np.allclose([d.embedding for d in default.data], want, atol=1e-6)
    assert [d.index for d in default.data] == [0, 1, 2, 3]
    assert np.allclose(floats.data[0].embedding, want[0], atol=1e-6)
    ids = embed_rt.encode(DOCS[0], add_special_tokens=True)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == len(ids)
    as_ids = client.embeddings.create(model="all-MiniLM-L6-v2", input=[ids, ids])
    assert np.allclose(as_ids.data[1].embedding, want[0], atol=1e-5)
    with pytest.raises(BadRequestError) as e:
        client.embeddings.create(model="all-MiniLM-L6-v2", input="x", dimensions=64)
    assert e.value.body["code"] == "dimensions_not_supported" and e.value.body["param"] == "dimensions"
    with pytest.raises(BadRequestError) as e:
        client.embeddings.create(model="all-MiniLM-L6-v2", input="word " * 300)
    assert e.value.body["code"] == "input_too_long"
    cut = client.embeddings.create(model="all-MiniLM-L6-v2", input="word " * 300, extra_body={"truncate": True})
    assert cut.usage.prompt_tokens == 256
    with pytest.raises(BadRequestError) as e:
        client.chat.completions.create(model="all-MiniLM-L6-v2", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "unsupported_task"


def test_cohere_clients_rerank(servers, rerank_rt):
    import cohere

    want = rerank_rt.rerank(RerankRequest(QUERY, DOCS, top_n=3)).hits
    v2 = cohere.ClientV2(api_key="unused", base_url=servers["rerank"]).rerank(
        model="cross", query=QUERY, documents=DOCS, top_n=3
    )
    assert [(r.index, round(r.relevance_score, 6)) for r in v2.results] == [(h.index, round(h.score, 6)) for h in want]
    v1 = cohere.Client(api_key="unused", base_url=servers["rerank"]).rerank(
        model="cross", query=QUERY, documents=[{"text": d} for d in DOCS], top_n=3, return_documents=True
    )
    assert [r.index for r in v1.results] == [h.index for h in want]
    assert v1.results[0].document.text == DOCS[want[0].index]
    with pytest.raises(cohere.BadRequestError):  # the embedding server's model does not rerank
        cohere.ClientV2(api_key="unused", base_url=servers["embed"]).rerank(
            model="all-MiniLM-L6-v2", query=QUERY, documents=DOCS
        )


def test_a_jina_shaped_rerank_request(servers, rerank_rt):
    import httpx

    body = {"model": "cross", "query": QUERY, "documents": DOCS, "top_n": 2}  # what LangChain's JinaRerank posts
    answer = httpx.post(servers["rerank"] + "/v1/rerank", json=body, timeout=30).json()
    want = rerank_rt.rerank(RerankRequest(QUERY, DOCS, top_n=2)).hits
    assert [(r["index"], r["document"]["text"]) for r in answer["results"]] == [(h.index, DOCS[h.index]) for h in want]
    assert answer["usage"]["total_tokens"] > 0
    bad = httpx.post(servers["rerank"] + "/rerank", json={**body, "top_k": 2}, timeout=30)
    assert bad.status_code == 400 and "top_k" in bad.json()["error"]["message"]


def test_admission_counts_each_input(embed_rt):
    import httpx

    from exllama_integrations.serve.state import ServeLimits

    server = ThreadServer(embed_rt, limits=ServeLimits(max_pending=4))
    try:
        state = server.app.state.serve
        state.pending = 2  # two generations in flight: five inputs do not fit beside them, two do
        full = httpx.post(server.url + "/v1/embeddings", json={"input": DOCS + ["x"]}, timeout=30)
        assert full.status_code == 503 and full.headers["retry-after"] == "1"
        assert httpx.post(server.url + "/v1/embeddings", json={"input": DOCS[:2]}, timeout=30).status_code == 200
        state.pending = 0  # alone, a request larger than the limit is admitted
        assert httpx.post(server.url + "/v1/embeddings", json={"input": DOCS + ["x"]}, timeout=30).status_code == 200
        assert state.pending == 0
    finally:
        server.stop()
