"""A small invalid body is no amplifier: every endpoint refuses it typed, at its first bad item, at once.

A 3 MB body of a million wrong items (under the 8 MiB body cap) used to make pydantic build an error per item and
per shape it tried (two million for ``/v1/embeddings``' ``input``: 34-64 s of the event loop, +2.5 GB) for a 400
that shows five. Each endpoint here gets such a body while ``/health`` is asked every 50 ms beside it: the answer is a
typed 400 naming the bad item, in well under a second, and ``/health`` never waits long.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from servers import ThreadServer

from exllama_integrations.runtime.local import EmbeddingRuntime

MILLION = 1_000_000
CHAT = [{"role": "user", "content": "hi"}]

CASES = {
    # endpoint: (server, path, body)
    "embeddings": ("embed", "/v1/embeddings", {"input": [1] * MILLION + ["x"]}),
    "embeddings, token lists": ("embed", "/v1/embeddings", {"input": [[1, 2]] * 2 + [["x"] * MILLION]}),
    "completions": ("chat", "/v1/completions", {"prompt": [1] * MILLION + ["x"]}),
    "chat": ("chat", "/v1/chat/completions", {"messages": [{"role": "nobody"}] * 300_000}),
    "chat, stop ids": ("chat", "/v1/chat/completions", {"messages": CHAT, "stop_token_ids": ["x"] * MILLION}),
    "chat, logit_bias": (
        "chat",
        "/v1/chat/completions",
        {"messages": CHAT, "logit_bias": {str(i): "x" for i in range(100_000)}},
    ),
    "responses": ("chat", "/v1/responses", {"input": [1] * MILLION}),
    "messages": ("chat", "/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": [1] * MILLION}]}),
    "rerank": ("rerank", "/v1/rerank", {"query": "q", "documents": [1] * MILLION}),
    "native embed": ("embed", "/v1/exllama/embed", {"inputs": [1] * MILLION + ["x"]}),
    "native rerank": ("rerank", "/v1/exllama/rerank", {"query": "q", "documents": [1] * MILLION}),
    "native generate": ("chat", "/v1/exllama/generate", {"prompt": ["x"] * MILLION}),
}


@pytest.fixture(scope="module")
def urls(demo_runtime, minilm_dir, tmp_path_factory):
    from retrieval_models import make_cross_encoder

    embed = EmbeddingRuntime.shared(minilm_dir)
    rerank = EmbeddingRuntime(make_cross_encoder(tmp_path_factory.mktemp("cross") / "cross", minilm_dir))
    servers = {"chat": ThreadServer(demo_runtime), "embed": ThreadServer(embed), "rerank": ThreadServer(rerank)}
    yield {k: s.url for k, s in servers.items()}
    for s in servers.values():
        s.stop()
    rerank.close()


@pytest.mark.parametrize("case", list(CASES))
def test_a_million_wrong_items_get_a_typed_400_at_once(urls, case):
    where, path, body = CASES[case]
    url = urls[where]
    raw = json.dumps(body).encode()
    assert 1_000_000 < len(raw) < 8 * 2**20  # over a megabyte, under the body cap: it reaches validation
    answer: dict = {}

    def send() -> None:
        t0 = time.perf_counter()
        r = httpx.post(url + path, content=raw, headers={"content-type": "application/json"}, timeout=120)
        answer.update(status=r.status_code, body=r.json(), seconds=time.perf_counter() - t0)

    sender = threading.Thread(target=send)
    health: list[float] = []
    with httpx.Client(timeout=120) as client:
        sender.start()
        while sender.is_alive():
            t0 = time.perf_counter()
            assert client.get(url + "/health").status_code == 200
            health.append(time.perf_counter() - t0)
            time.sleep(0.05)
    sender.join()
    assert answer["status"] == 400, answer["body"]
    error = answer["body"].get("error", answer["body"])
    assert error.get("message") or error.get("error"), answer["body"]
    # 3 MB travel, are parsed and checked once; an error per item took 15-64 s here
    assert answer["seconds"] < 2.0, answer["seconds"]
    assert max(health, default=0.0) < 1.0, max(health)


def test_the_400_names_the_first_bad_item(urls):
    r = httpx.post(urls["embed"] + "/v1/embeddings", json={"input": [1, 2, 3, "x", "y"]}, timeout=30)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "input"
    assert "input[3] is a text in a list of token ids" in error["message"]
    r = httpx.post(urls["chat"] + "/v1/completions", json={"prompt": ["a"] * 65}, timeout=30)
    assert r.status_code == 400 and "at most 64" in r.json()["error"]["message"]


def test_a_valid_list_still_passes(urls):
    r = httpx.post(urls["embed"] + "/v1/embeddings", json={"input": [[101, 7592, 102], "hello"]}, timeout=30)
    assert r.status_code == 400  # a mix of shapes is refused typed, as before
    r = httpx.post(urls["embed"] + "/v1/embeddings", json={"input": [[101, 7592, 102], [101, 2088, 102]]}, timeout=30)
    assert r.status_code == 200 and len(r.json()["data"]) == 2
    r = httpx.post(urls["chat"] + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text
