"""A served request's images are counted before any is fetched, and /tokenize counts in admission (issue 34).

Every chat API (chat completions, Messages, Responses) prepares its body in one place, which counts the image
parts of the whole body before anything is fetched or decoded; /tokenize, which renders templates and reads
images too, is refused like a generation when the server is full. Servers and the image host listen on 127.0.0.1.
"""

from __future__ import annotations

import http.server
import threading

import httpx
import pytest

from exllama_integrations.model.media import MediaLimits
from exllama_integrations.serve.app import ServeLimits

PNG = b"\x89PNG\r\n\x1a\n" + bytes(32)


@pytest.fixture(scope="module")
def image_host():
    fetched: list[str] = []

    class Host(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            fetched.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(PNG)

        def log_message(self, *args: object) -> None:
            pass

    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Host)
    threading.Thread(target=host.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{host.server_address[1]}", fetched
    host.shutdown()


@pytest.fixture(scope="module")
def server(demo_runtime):
    from servers import ThreadServer

    media = MediaLimits(fetch_urls=True, fetch_allow=("127.0.0.1",), max_images=2)
    s = ThreadServer(demo_runtime, limits=ServeLimits(media=media))
    yield s.url
    s.stop()


def _bodies(url: str, n: int) -> dict[str, dict]:
    urls = [f"{url}/{i}.png" for i in range(n)]
    return {
        "/v1/chat/completions": {
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in urls]}],
            "max_tokens": 2,
        },
        "/v1/messages": {
            "model": "SmolLM2-135M-Instruct",
            "max_tokens": 2,
            "messages": [
                {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": u}} for u in urls]}
            ],
        },
        "/v1/responses": {
            "max_output_tokens": 2,
            "input": [{"role": "user", "content": [{"type": "input_image", "image_url": u} for u in urls]}],
        },
    }


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
def test_images_are_refused_before_any_is_fetched(server, image_host, path):
    url, fetched = image_host
    fetched.clear()
    for n in (3, 2):  # over the count, and within it: the text-only model refuses both before fetching (issue 49)
        r = httpx.post(server + path, json=_bodies(url, n)[path], timeout=30)
        assert r.status_code == 400 and "takes no images" in r.text
    assert fetched == []


def test_the_image_count_is_checked_before_any_fetch(demo_runtime):
    """For a model that takes images, the count is the state's first check (every chat API calls it)."""
    import dataclasses

    from exllama_integrations.errors import MediaError
    from exllama_integrations.serve.state import ServeState

    seeing = dataclasses.replace(demo_runtime.model_info(), accepts_images=True)
    runtime = type("Seeing", (), {"model_info": lambda self: seeing, "closed": False})()
    state = ServeState(runtime, "seeing", ServeLimits(media=MediaLimits(max_images=2)))
    with pytest.raises(MediaError, match="at most 2 images"):
        state.check_images(3)
    state.check_images(2)
    text_only = ServeState(demo_runtime, "text", ServeLimits(media=MediaLimits(max_images=2)))
    with pytest.raises(MediaError, match="takes no images"):
        text_only.check_images(1)


def test_tokenize_counts_in_admission(demo_runtime):
    from servers import ThreadServer

    full = ThreadServer(demo_runtime, limits=ServeLimits(max_pending=0))
    try:
        r = httpx.post(full.url + "/tokenize", json={"prompt": "Hello there"}, timeout=30)
        assert r.status_code == 503 and r.headers.get("retry-after")
    finally:
        full.stop()
