"""The server's limits and edges: max_tokens capped, the API docs behind the key, OpenAI errors for unknown routes
and chunked bodies, a trickling body timed out, a forged log line impossible, a leaving client cancelled, the
CLI's version and defaults. (From the review at b073b3e, round 3.)
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from servers import ThreadServer


@pytest.fixture(scope="module")
def capped(demo_runtime):
    from exllama_integrations.serve.state import ServeLimits

    limits = ServeLimits(max_tokens=5, max_body_bytes=2048, body_timeout=1.5)
    server = ThreadServer(demo_runtime, api_key="k", limits=limits)
    yield server
    server.stop()


KEY = {"Authorization": "Bearer k"}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_max_tokens_caps_the_resolved_settings_not_the_field(capped, path):
    body = {"prompt": "Count: 1, 2, 3,", "ignore_eos": True, "temperature": 0}
    if path.endswith("chat/completions"):
        body = {"messages": [{"role": "user", "content": "Count to ten."}], "ignore_eos": True}
    r = httpx.post(capped.url + path, json=body, headers=KEY, timeout=60)  # max_tokens left out
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 5
    r = httpx.post(capped.url + path, json={**body, "max_tokens": 6}, headers=KEY, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "max_tokens_too_large"


def test_the_api_docs_need_the_key_and_health_tells_no_pid(capped):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(capped.url + path, timeout=10).status_code == 401
        assert httpx.get(capped.url + path, headers=KEY, timeout=10).status_code == 200
    health = httpx.get(capped.url + "/health", timeout=10).json()
    assert "pid" not in health and health["status"] == "ok"


def test_unknown_routes_wrong_methods_and_chunked_bodies_answer_openai_errors(capped):
    r = httpx.get(capped.url + "/v1/nothing", headers=KEY, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(capped.url + "/v1/completions", headers=KEY, timeout=10)
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"

    def chunks():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 1024
        yield b'"}'

    r = httpx.post(capped.url + "/v1/completions", content=chunks(), headers=KEY, timeout=10)  # no Content-Length
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    bad = b'{"prompt": "\xff\xfe", "max_tokens": 2}'
    r = httpx.post(capped.url + "/v1/completions", content=bad, headers={**KEY, "content-type": "application/json"})
    assert r.status_code in (400, 422) and "error" in r.json()
    deep = b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    r = httpx.post(
        capped.url + "/v1/completions", content=deep[:2000], headers={**KEY, "content-type": "application/json"}
    )
    assert r.status_code in (400, 422) and "error" in r.json()


def test_a_client_that_trickles_its_body_gets_408_and_its_slot_back(capped):
    body = b'{"prompt": "Hi", "max_tokens": 2}'
    with socket.create_connection(("127.0.0.1", capped.port), timeout=10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer k\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
        )
        t0 = time.perf_counter()
        answer = b""
        for byte in body:  # one byte a second: slower than the 1.5 s the whole body may take
            try:
                s.sendall(bytes([byte]))
            except OSError:
                break
            s.settimeout(1.0)
            try:
                answer += s.recv(4096)
            except TimeoutError:
                continue
            if answer:
                break
        waited = time.perf_counter() - t0
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer
    assert waited < 5  # not the 30 s it would have taken to trickle the body
    assert capped.app.state.serve.pending == 0


def test_the_log_line_cannot_be_forged_through_the_path(capped, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="exllama_integrations.serve")
    httpx.post(capped.url + "/v1/completions%0Aid=forged POST /x 200", json={}, headers=KEY, timeout=10)
    lines = [r.getMessage() for r in caplog.records if "POST" in r.getMessage()]
    assert lines and all("\n" not in line for line in lines)


def test_a_non_streamed_request_whose_client_leaves_is_cancelled(demo_runtime):
    server = ThreadServer(demo_runtime)
    try:
        body = json.dumps({"prompt": "Count:", "max_tokens": 2000, "ignore_eos": True}).encode()
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            head = (
                "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n\r\n"
            )
            s.sendall(head.encode() + body)
            t0 = time.perf_counter()
            while demo_runtime.active_requests == 0 and time.perf_counter() - t0 < 10:
                time.sleep(0.02)
            assert demo_runtime.active_requests == 1
        t0 = time.perf_counter()  # the client is gone: its 2,000 tokens are not generated
        while demo_runtime.active_requests and time.perf_counter() - t0 < 10:
            time.sleep(0.05)
        assert demo_runtime.active_requests == 0 and time.perf_counter() - t0 < 10
        assert server.app.state.serve.pending == 0  # its admission slot is back
    finally:
        server.stop()


def test_the_model_field_may_be_left_out_and_models_have_a_creation_time(capped):
    r = httpx.post(capped.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=KEY, timeout=60)
    assert r.status_code == 200
    card = httpx.get(capped.url + "/v1/models", headers=KEY, timeout=10).json()["data"][0]
    assert card["created"] > 1_700_000_000 and card["max_model_len"] == card["context_length"] > 0


def test_the_cli_says_its_version_and_its_defaults():
    import subprocess
    import sys

    run = [sys.executable, "-m", "exllama_integrations"]
    out = subprocess.run([*run, "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("exllama-integrations ")
    help_text = subprocess.run([*run, "serve", "--help"], capture_output=True, text=True, timeout=60).stdout
    assert "(default: 8000)" in help_text and "--max-model-len" in help_text and "--chat-template" in help_text
    assert "(default: None)" not in help_text
    assert subprocess.run([*run, "serve", "-v", "--help"], capture_output=True, timeout=60).returncode == 0
