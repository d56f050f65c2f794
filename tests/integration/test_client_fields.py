"""Fields clients send are honoured as they mean them, and a refused one is hinted at usefully.

* Cohere's ``max_tokens_per_doc`` is a number: with 16, each document is scored on its first 16 tokens (it was read
  as on/off: a long document was scored on the model's whole limit).
* A field refused on one endpoint that another endpoint takes (``top_k`` on a rerank, ``echo`` on a chat) is not
  answered with "did you mean" itself.
"""

from __future__ import annotations

import httpx
import pytest
from servers import ThreadServer, demo_server

from exllama_integrations.contract.retrieval import RerankRequest
from exllama_integrations.runtime.local import EmbeddingRuntime

QUERY = "What is the capital of France?"
LONG = "Paris is the capital and largest city of France. " * 40  # hundreds of tokens


@pytest.fixture(scope="module")
def rerank(tmp_path_factory, minilm_dir):
    from retrieval_models import make_cross_encoder

    rt = EmbeddingRuntime(make_cross_encoder(tmp_path_factory.mktemp("cross") / "cross", minilm_dir))
    server = ThreadServer(rt)
    yield rt, server.url
    server.stop()
    rt.close()


def test_cohere_max_tokens_per_doc_cuts_each_document_to_that_many_tokens(rerank):
    import cohere

    rt, url = rerank
    first16 = rt.decode(rt.encode(LONG, add_special_tokens=False)[:16])
    short = rt.rerank(RerankRequest(QUERY, [first16, "Bananas are yellow."]))
    query_tokens = len(rt.encode(QUERY, add_special_tokens=False))
    answer = cohere.ClientV2(api_key="unused", base_url=url).rerank(
        model="cross", query=QUERY, documents=[LONG, "Bananas are yellow."], max_tokens_per_doc=16
    )
    scores = {r.index: r.relevance_score for r in answer.results}
    want = {h.index: h.score for h in short.hits}
    assert scores[0] == pytest.approx(want[0], abs=1e-6)  # the long document read as its first 16 tokens
    assert answer.meta.tokens.input_tokens == short.prompt_tokens
    assert short.prompt_tokens < 2 * (query_tokens + 16 + 3)  # [CLS] q [SEP] d [SEP], two short pairs
    whole = rt.rerank(RerankRequest(QUERY, [LONG], truncate=True))
    assert whole.prompt_tokens > 100 and whole.hits[0].score != pytest.approx(want[0], abs=1e-6)


def test_a_field_of_another_endpoint_is_not_suggested_as_itself(rerank, demo_dir):
    _, url = rerank
    bad = httpx.post(url + "/v1/rerank", json={"query": QUERY, "documents": ["a"], "top_k": 1}, timeout=30)
    message = bad.json()["error"]["message"]
    assert bad.status_code == 400 and "top_k" in message
    assert "did you mean 'top_k'" not in message
    chat = demo_server()
    bad = httpx.post(
        chat + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "echo": True}
    )
    message = bad.json()["error"]["message"]
    assert bad.status_code == 400 and "echo: unknown field here" in message and "did you mean 'echo'" not in message
    hi = [{"role": "user", "content": "hi"}]  # a block's field at the top of a Messages body
    bad = httpx.post(chat + "/v1/messages", json={"model": "m", "max_tokens": 1, "messages": hi, "name": "x"})
    message = bad.json()["error"]["message"]
    assert bad.status_code == 400 and "name" in message and "did you mean 'name'" not in message
