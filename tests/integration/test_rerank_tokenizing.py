"""A rerank tokenizes its query once and its documents in chunks, and stops when its client goes away.

Before, each (query, document) pair was tokenized whole with a call that holds the GIL: a 1.5 MB query stalled
every model 4-5 s per pass, and a client that disconnected did not stop it. Through the real tokenizer of
all-MiniLM-L6-v2 (a BERT cross-encoder on random weights): the query goes through the tokenizer once, the pairs are
exactly what the tokenizer makes of (query, document), truncation included, and a server stops tokenizing once the
client has gone.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import httpx
import pytest
from servers import ThreadServer

from exllama_integrations.contract.retrieval import RerankRequest
from exllama_integrations.runtime.local import EmbeddingRuntime


class CountingTokenizer:
    """The real ``tokenizers.Tokenizer``, recording every text it is asked to tokenize."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.texts: list[str] = []

    def encode(self, *texts: Any, **kw: Any) -> Any:
        self.texts += [t for t in texts if isinstance(t, str)]
        return self.inner.encode(*texts, **kw)

    def encode_batch(self, texts: list[Any], **kw: Any) -> Any:
        self.texts += [t for x in texts for t in ([x] if isinstance(x, str) else x)]
        return self.inner.encode_batch(texts, **kw)

    def encode_batch_fast(self, texts: list[Any], **kw: Any) -> Any:
        self.texts += [t for x in texts for t in ([x] if isinstance(x, str) else x)]
        return self.inner.encode_batch_fast(texts, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture()
def cross(tmp_path_factory, minilm_dir):
    from retrieval_models import make_cross_encoder

    path = tmp_path_factory.getbasetemp() / "cross-tok" / "cross"
    if not path.exists():
        make_cross_encoder(path, minilm_dir)
    rt = EmbeddingRuntime(path)
    counting = CountingTokenizer(rt._inputs.tok)
    rt._inputs.tok = counting
    yield rt, counting
    rt.close()


def test_the_query_is_tokenized_once(cross):
    rt, counting = cross
    query = "Which city is the capital of France, and what is it known for?"
    docs = [f"Document {i}: Paris is the capital of France." for i in range(20)]
    hits = rt.rerank(RerankRequest(query, docs)).hits
    assert len(hits) == 20
    assert counting.texts.count(query) == 1  # was 20: once per document
    assert sum(t in docs for t in counting.texts) == 20


@pytest.mark.parametrize("limit", [128, 127])  # an even and an odd budget: longest-first gives the odd token
def test_each_pair_is_what_the_tokenizer_makes_of_it(cross, limit):
    from tokenizers import Tokenizer

    rt, counting = cross
    inputs = rt._inputs
    inputs.max_tokens = limit
    inputs.cut = Tokenizer.from_str(counting.inner.to_str())
    inputs.cut.enable_truncation(limit, strategy="longest_first")
    words = ["alpha", "beta", "gamma", "delta"]
    sizes = [1, 40, 61, 62, 63, 64, 100, 124, 125, 126, 200, 400]
    for q in sizes:
        query = " ".join(words[i % 4] for i in range(q))
        docs = [" ".join(words[(i * 7) % 4] for i in range(d)) for d in sizes]
        got = inputs.pairs(RerankRequest(query, docs, truncate=True))
        for pair, doc in zip(got, docs, strict=True):
            want = counting.inner.encode(query, doc)
            if len(want.ids) > limit:
                want = inputs.cut.encode(query, doc)
            assert (pair.ids, pair.type_ids) == (tuple(want.ids), tuple(want.type_ids)), (q, len(doc.split()))


def test_a_client_that_goes_away_stops_the_tokenizing(cross):
    rt, counting = cross
    server = ThreadServer(rt)
    try:
        docs = [f"doc {i} " + "word " * 20_000 for i in range(64)]  # 6.4 MB of text: seconds of tokenizing
        body = json.dumps({"query": "which word?", "documents": docs, "truncate": True}).encode()
        head = (
            f"POST /v1/rerank HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(head + body)
        t0 = time.perf_counter()
        while "which word?" not in counting.texts:  # the work has begun
            assert time.perf_counter() - t0 < 60
            time.sleep(0.01)
        sock.close()
        time.sleep(3.0)
        seen = sum(t in docs for t in counting.texts)
        assert seen < len(docs), seen  # stopped after a chunk or two, not all 64 documents
        time.sleep(1.0)
        assert sum(t in docs for t in counting.texts) == seen  # and stays stopped
        small = {"query": "cats", "documents": ["a cat", "a car"]}
        assert httpx.post(server.url + "/v1/rerank", json=small, timeout=30).status_code == 200
    finally:
        server.stop()
