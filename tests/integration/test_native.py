"""The native wire endpoint and RemoteRuntime: the contract over HTTP, typed errors as themselves, bounded reading.

RemoteRuntime speaks ``/v1/exllama/generate`` only (the OpenAI endpoints are for third-party clients); an
error raised in the server's runtime arrives as the same class, fields included; and a broken or hostile
server gives a typed error within the call's deadline, never a raw exception or a hang.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import pytest
from proxy_runtime import ThreadProxyRuntime
from servers import ThreadServer

from exllama_integrations import errors
from exllama_integrations.contract import wire
from exllama_integrations.contract.api import GenerationRequest
from exllama_integrations.runtime.remote import RemoteRuntime

from helpers import error_instances

PROMPT = "The capital of France is"


class _Raising(ThreadProxyRuntime):
    """A runtime whose generations fail with a chosen typed error (as a backend or a check would raise it)."""

    error: errors.ExLlamaIntegrationsError | None = None

    def tokenizer_files(self):
        return self._inner.tokenizer_files()

    def open(self, request):
        if self.error is not None:
            raise self.error
        return super().open(request)


@pytest.fixture(scope="module")
def raising(demo_runtime):
    rt = _Raising(demo_runtime)
    server = ThreadServer(rt)
    yield rt, server
    server.stop()


@pytest.mark.parametrize("error", error_instances(), ids=lambda e: type(e).__name__)
def test_a_typed_error_in_the_servers_runtime_is_the_same_class_in_the_client(raising, error):
    rt, server = raising
    client = RemoteRuntime(server.url)
    rt.error = error
    try:
        with pytest.raises(type(error)) as got:
            client.generate(PROMPT, max_tokens=2)
        assert type(got.value) is type(error) and str(got.value) == str(error)
        assert got.value.wire_fields() == error.wire_fields()
    finally:
        rt.error = None
        client.close()


def test_remote_runtime_speaks_the_native_endpoint_only(demo_runtime, caplog):
    server = ThreadServer(demo_runtime)
    caplog.set_level(logging.INFO, logger="exllama_integrations.serve")
    try:
        client = RemoteRuntime(server.url)
        r = client.generate(PROMPT, temperature=0, max_tokens=4)
        local = demo_runtime.generate(PROMPT, temperature=0, max_tokens=4)
        assert r.text == local.text and r.token_ids == local.token_ids and r.usage == local.usage
        streamed = [c for c in client.stream(PROMPT, temperature=0, max_tokens=4)]
        assert "".join(c.text for c in streamed) == local.text and streamed[-1].usage == local.usage
        client.close()
    finally:
        server.stop()
    posts = [r.getMessage() for r in caplog.records if "POST" in r.getMessage()]
    assert posts and all("/v1/exllama/generate" in p for p in posts), posts


def test_the_wire_endpoint_refuses_a_bad_body_typed(demo_runtime):
    import httpx

    server = ThreadServer(demo_runtime)
    try:
        r = httpx.post(server.url + "/v1/exllama/generate", content=b'{"prompt": 5}', timeout=30)
        assert r.status_code == 400
        assert isinstance(wire.loads_error(r.content, r.status_code), errors.InvalidSettingsError)
        good = wire.dumps(GenerationRequest(PROMPT))
        r = httpx.post(server.url + "/v1/exllama/generate", content=good[:-10], timeout=30)
        assert r.status_code == 400 and "request" in r.json()["error"]["message"]
    finally:
        server.stop()


# ------------------------------------------------------------------ a broken or hostile server


class _FakeServer:
    """A raw HTTP server on 127.0.0.1 that answers each path as ``routes`` says (bytes, or a callable writing them)."""

    def __init__(self, routes: dict[str, object]) -> None:
        self.routes = routes
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(5)
        try:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, rest = data.partition(b"\r\n\r\n")
            path = head.split(b" ")[1].decode()
            length = next(
                (int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")), 0
            )
            while len(rest) < length:
                rest += conn.recv(65536)
            answer = self.routes.get(path, b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
            if callable(answer):
                answer(conn, self._stop)
            else:
                conn.sendall(answer)  # type: ignore[arg-type]
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self.sock.close()


def _json(obj: object, status: str = "200 OK") -> bytes:
    body = json.dumps(obj).encode()
    head = f"HTTP/1.1 {status}\r\nconnection: close\r\ncontent-type: application/json\r\n"
    return (head + f"content-length: {len(body)}\r\n\r\n").encode() + body


def _real_answers(demo_runtime) -> tuple[dict, dict]:
    info = {"info": wire.to_data(demo_runtime.model_info()), "served_model_name": "demo"}
    return info, demo_runtime.tokenizer_files()


def _sse(events: list[bytes]) -> bytes:
    body = b"".join(events)
    head = "HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-type: text/event-stream\r\n"
    return (head + f"content-length: {len(body)}\r\n\r\n").encode() + body


def _endless(comment: bytes):
    def write(conn: socket.socket, stop: threading.Event) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        t0 = time.monotonic()
        while not stop.is_set() and time.monotonic() - t0 < 20:
            conn.sendall(b"%x\r\n%s\r\n" % (len(comment), comment))
            time.sleep(0.05)

    return write


@pytest.mark.parametrize(
    ("case", "error"),
    [
        ("info-not-json", errors.ProtocolError),
        ("info-missing-fields", errors.ProtocolError),
        ("tokenizer-bad-base64", errors.ProtocolError),
        ("info-html-500", errors.ServerError),
    ],
)
def test_a_broken_server_is_refused_typed_when_connecting(demo_runtime, tmp_path, case, error):
    info, tokenizer = _real_answers(demo_runtime)
    routes: dict[str, object] = {"/v1/exllama/info": _json(info), "/v1/exllama/tokenizer": _json(tokenizer)}
    if case == "info-not-json":
        routes["/v1/exllama/info"] = b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nnot json!"
    elif case == "info-missing-fields":
        routes["/v1/exllama/info"] = _json({"info": {"name": "m"}})
    elif case == "tokenizer-bad-base64":
        routes["/v1/exllama/tokenizer"] = _json({"name": "m", "tokenizer.json": None, "tokenizer.model": "!!notb64"})
    elif case == "info-html-500":
        routes["/v1/exllama/info"] = b"HTTP/1.1 500 Oops\r\ncontent-length: 13\r\n\r\n<html></html>"
    server = _FakeServer(routes)
    try:
        with pytest.raises(error):
            RemoteRuntime(server.url, cache_dir=tmp_path, timeout=5)
    finally:
        server.close()


def test_a_newer_server_with_more_fields_is_read(demo_runtime, tmp_path):
    info, tokenizer = _real_answers(demo_runtime)
    info["info"]["a_field_from_the_future"] = [1, 2]
    info["future"] = True
    server = _FakeServer({"/v1/exllama/info": _json(info), "/v1/exllama/tokenizer": _json(tokenizer)})
    try:
        rt = RemoteRuntime(server.url, cache_dir=tmp_path, timeout=5)
        assert rt.model_info().name == demo_runtime.model_info().name and rt.count_tokens("hello") > 0
        rt.close()
    finally:
        server.close()


@pytest.mark.parametrize("case", ["malformed-event", "finish-without-usage", "cut-short", "keep-alives-forever"])
def test_a_hostile_stream_ends_typed_within_the_deadline(demo_runtime, tmp_path, case):
    info, tokenizer = _real_answers(demo_runtime)
    events = {
        "malformed-event": _sse([b'data: {"text": "a"}\n\n', b"data: {not json\n\n"]),
        "finish-without-usage": _sse([b'data: {"text": 7, "finish_reason": "eos"}\n\n']),
        "cut-short": _sse([b'data: {"text": "a"}\n\n']),
        "keep-alives-forever": _endless(b": keep-alive\n\n"),
    }[case]
    routes = {
        "/v1/exllama/info": _json(info),
        "/v1/exllama/tokenizer": _json(tokenizer),
        "/v1/exllama/generate": events,
    }
    server = _FakeServer(routes)
    try:
        rt = RemoteRuntime(server.url, cache_dir=tmp_path, timeout=2)
        t0 = time.monotonic()
        with pytest.raises((errors.ProtocolError, errors.ServerError)):
            rt.generate(PROMPT)
        assert time.monotonic() - t0 < 10
        rt.close()
    finally:
        server.close()


def test_a_server_that_never_answers_does_not_block_the_constructor(tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)  # accepts the connection, never answers
    try:
        t0 = time.monotonic()
        with pytest.raises(errors.ServerError):
            RemoteRuntime(f"http://127.0.0.1:{sock.getsockname()[1]}", cache_dir=tmp_path, timeout=2)
        assert time.monotonic() - t0 < 10
    finally:
        sock.close()
