"""Fields clients send are honoured as they mean them, and a refused one is hinted at usefully.

* Cohere's ``max_tokens_per_doc`` is a number: with 16, each document is scored on its first 16 tokens (it was read
  as on/off: a long document was scored on the model's whole limit).
* ``/v1/models`` lists an embedding model's context as the model reads it (``max_seq_length``: MiniLM's 256) before
  it loads, as after (it said 512, ``max_position_embeddings``, until the model loaded).
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
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 1, "messages": hi, "name": "x"}
    bad = httpx.post(chat + "/v1/messages", json=body)
    message = bad.json()["error"]["message"]
    assert bad.status_code == 400 and "name" in message and "did you mean 'name'" not in message


def test_models_lists_an_embedding_models_context_as_it_reads_before_and_after_it_loads(tmp_path, minilm_dir):
    import os
    import socket
    import subprocess
    import sys

    from servers import wait_until_up

    (tmp_path / "serve.toml").write_text(f'[[models]]\nname = "minilm"\nmodel_dir = "{minilm_dir}"\nram = "200MiB"\n')
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "exllama_integrations", "serve", "--config", str(tmp_path / "serve.toml")]
    proc = subprocess.Popen(
        [*command, "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        wait_until_up(url, 180, proc)

        def card() -> dict:
            return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]

        before = card()  # not loaded yet: read from its files
        assert before["context_length"] == 256  # sentence_bert_config's max_seq_length, not max_position_embeddings 512
        long = {"model": "minilm", "input": "word " * 300, "truncate": True}
        answer = httpx.post(url + "/v1/embeddings", json=long, timeout=120).json()
        assert answer["usage"]["prompt_tokens"] == 256 == card()["context_length"]  # loaded: the same
    finally:
        proc.terminate()
        proc.wait(60)
