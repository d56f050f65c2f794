"""`exllama-integrations serve` as a user runs it: a process on 127.0.0.1, drained gracefully on SIGTERM."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from servers import wait_until_up as _wait_until_up

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_drains_a_stream_in_flight_on_sigterm(demo_dir):
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "exllama_integrations",
            "--verbose",
            "serve",
            "--model-dir",
            str(demo_dir),
            "--backend",
            "transformers",
            "--port",
            str(port),
            "--api-key",
            "k1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_up(url)
        lines: list[str] = []
        started = threading.Event()

        def read() -> None:
            body = {
                "model": "SmolLM2-135M-Instruct",
                "prompt": "Tell me a story.",
                "max_tokens": 40,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            with httpx.stream(
                "POST", url + "/v1/completions", json=body, headers={"Authorization": "Bearer k1"}, timeout=60
            ) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                    started.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert started.wait(60)
        proc.send_signal(signal.SIGTERM)  # what a container stop or systemd sends
        reader.join(60)
        assert lines[-1] == "data: [DONE]", "the stream in flight was cut instead of drained"
        usage = [json.loads(x[6:])["usage"] for x in lines if x.startswith("data: {") and '"usage"' in x]
        assert usage and usage[-1]["completion_tokens"] == 40
        assert proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.stdout.read() if proc.stdout else ""
    assert "127.0.0.1" in out and "Waiting for connections to close" in out and "Application shutdown complete" in out
    assert "objects alive at startup are left out of garbage collection" in out  # no full-collection pauses


def test_serve_closes_connections_whose_headers_never_come(demo_dir):
    """Slow-header clients (one that sends nothing, one that trickles its head) lose their connection after
    ``--header-timeout``; a normal request on the same server is answered. With ``--allow-image-urls`` and the
    image's host allowed, this text-only model still refuses the image before fetching it (issue 49: nothing is
    fetched for a model that takes no images; the flags' effect on a vision model is test_images')."""
    import http.server
    import threading

    fetched: list[str] = []

    class Host(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            fetched.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(b"\x89PNG")

        def log_message(self, *args: object) -> None:
            pass

    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Host)
    threading.Thread(target=host.serve_forever, daemon=True).start()
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "exllama_integrations", "serve", "--model-dir", str(demo_dir), "--backend"]
        + ["transformers", "--port", str(port), "--header-timeout", "1.5", "--allow-image-urls"]
        + ["--image-url-allow", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_up(url)

        def closed_after(trickle: bytes) -> float:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                start = time.perf_counter()
                for byte in trickle:  # a byte every 0.5 s: each arrives, the head never completes in time
                    try:
                        s.sendall(bytes([byte]))
                    except OSError:
                        break
                    time.sleep(0.5)
                s.settimeout(10)
                try:
                    assert s.recv(1024) == b""  # closed by the server, nothing answered
                except ConnectionResetError:
                    pass
                return time.perf_counter() - start

        assert closed_after(b"") < 5
        assert closed_after(b"GET /health HTTP/1.1\r\nhost: x\r\n") < 5  # not the 16 s the trickle would take
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        image = f"http://127.0.0.1:{host.server_address[1]}/cat.png"
        part = {"type": "image_url", "image_url": {"url": image}}
        body = {"messages": [{"role": "user", "content": [part]}], "max_tokens": 2}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and "takes no images" in r.json()["error"]["message"]
        assert fetched == []
    finally:
        proc.terminate()
        proc.wait(30)
        host.shutdown()
