"""A server started with an API key, behind a gateway (docs/gateways.md, "API keys"): every path but ``/health``
wants the key, ``/metrics`` included, and SMG's ``--api-key`` is the key it sends to its workers and asks of its own
clients. Two tiny random-weight servers in this process and one SMG process per case, on 127.0.0.1; bounded in time.
"""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from servers import ThreadServer

KEY = "sk-test"
BEARER = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
NO_SMG = "smg (the gateway's PyPI wheel, in the test extra) is not installed: pip install smg"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory) -> Iterator[list[ThreadServer]]:
    """Two servers started with ``api_key=KEY`` over one tiny model."""
    from arch_models import make_arch

    from exllama_integrations import ExLlamaRuntime

    runtime = ExLlamaRuntime(make_arch("llama3", tmp_path_factory.mktemp("keys") / "tiny", seed=3), "transformers")
    servers = [ThreadServer(runtime, served_model_name="tiny", api_key=KEY) for _ in range(2)]
    yield servers
    for s in servers:
        s.stop()
    runtime.close()


def test_metrics_wants_the_key_and_health_does_not(keyed):
    url = keyed[0].url
    assert httpx.get(url + "/metrics", timeout=10).status_code == 401  # a scraper without the key
    assert httpx.get(url + "/v1/loads", timeout=10).status_code == 401
    assert httpx.get(url + "/v1/loads", headers={"x-api-key": KEY}, timeout=10).status_code == 200
    scraped = httpx.get(url + "/metrics", headers=BEARER, timeout=10)
    assert scraped.status_code == 200 and "vllm:num_requests_running" in scraped.text
    assert httpx.get(url + "/health", timeout=10).status_code == 200  # a load balancer's check needs none


def _smg(servers: list[ThreadServer], log: Path, *args: str) -> tuple[str, subprocess.Popen]:
    port = _free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "smg", "launch", "--host", "127.0.0.1", "--port", str(port)]
            + ["--worker-urls", *(s.url for s in servers), "--policy", "cache_aware"]
            + ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port())]
            + ["--load-monitor-interval", "1", "--worker-warmup-secs", "0", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return f"http://127.0.0.1:{port}", proc


def _workers(url: str, seconds: float) -> list[dict]:
    """SMG's ready workers, once both are ready or ``seconds`` have passed."""
    t0, ready = time.monotonic(), []
    while time.monotonic() - t0 < seconds:
        try:
            workers = httpx.get(url + "/workers", headers=BEARER, timeout=2).json()["workers"]
            ready = [w for w in workers if w["status"] == "ready" and w["is_healthy"]]
            if len(ready) == 2:
                break
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    return ready


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("smg") is None, reason=NO_SMG)
def test_smg_with_the_key_registers_keyed_servers_and_asks_it_of_its_clients(keyed, tmp_path):
    url, proc = _smg(keyed, tmp_path / "smg.log", "--api-key", KEY)
    try:
        assert len(_workers(url, 60)) == 2, (tmp_path / "smg.log").read_text()[-2000:]
        assert httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=60).status_code == 401
        assert httpx.get(url + "/workers", timeout=10).status_code == httpx.get(url + "/get_loads").status_code == 401
        wrong = {"Authorization": "Bearer wrong"}
        assert httpx.post(url + "/v1/chat/completions", json=CHAT, headers=wrong, timeout=60).status_code == 401
        r = httpx.post(url + "/v1/chat/completions", json=CHAT, headers=BEARER, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
        t0, want = time.monotonic(), {s.url: s.app.state.serve.info.context_length for s in keyed}
        while True:  # our /v1/loads, read with the key: SMG's view of each server's cache
            loads = httpx.get(url + "/get_loads", headers=BEARER, timeout=10).json()["loads"]
            if {row["worker"]: row["max_total_num_tokens"] for row in loads} == want:
                break
            assert time.monotonic() - t0 < 20, loads
            time.sleep(0.2)
    finally:
        proc.kill()
        proc.wait(15)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("smg") is None, reason=NO_SMG)
def test_smg_without_the_key_registers_no_keyed_server(keyed, tmp_path):
    url, proc = _smg(keyed, tmp_path / "smg.log")
    try:
        assert _workers(url, 10) == []  # their /v1/models answers SMG 401
        r = httpx.post(url + "/v1/chat/completions", json=CHAT, headers=BEARER, timeout=60)
        assert r.status_code == 404 and "No worker available" in r.text
    finally:
        proc.kill()
        proc.wait(15)
