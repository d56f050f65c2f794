"""What a client receives when the engine fails in the middle of a stream, on each API that streams.

Three streams (OpenAI chat completions, Anthropic Messages, the Responses API) run at once on the demo model in an
engine process; once each has sent some events, the engine process is killed (a real backend failure, as an
out-of-memory kill would be). Each client gets the events sent before the failure, then exactly one well-formed
error event in its API's shape, then the end of its stream: OpenAI (and vLLM) an ``error`` object in a data line,
then ``data: [DONE]``; Anthropic an ``event: error`` with ``{"type": "error", "error": {"type", "message"}}`` (an
engine that is unavailable is ``overloaded_error``, Anthropic's 529); the Responses API an ``error`` event
(``code``, ``message``, ``param``, ``sequence_number``), with no ``response.completed`` after it. Afterwards no
request is left counted: ``/metrics`` shows none running, the server admits as many as before, the runtime holds
none.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from exllama_integrations import ExLlamaRuntime

pytestmark = pytest.mark.slow

STORY = "Write a very long story about a dragon who learns to bake bread. Make it at least 2000 words."
EVENTS_BEFORE = 4
"""Content events each stream must have sent before the engine is killed."""


@pytest.fixture(scope="module")
def served(demo_dir):
    from servers import ThreadServer

    rt = ExLlamaRuntime(demo_dir, "transformers", engine="process")
    server = ThreadServer(rt)
    try:
        yield rt, server
    finally:
        server.stop()
        rt.close()


def _sse(lines: list[str]) -> list[tuple[str | None, str]]:
    """Server-sent events as (event name, data) pairs, in order."""
    out, name, data = [], None, []
    for line in [*lines, ""]:
        if not line:
            if data:
                out.append((name, "\n".join(data)))
            name, data = None, []
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
    return out


class Reader:
    """One streamed request read on a thread: its raw lines, and a flag once enough content has come."""

    def __init__(self, url: str, path: str, body: dict, content: Callable[[str], bool]) -> None:
        self.url, self.path, self.body, self.content = url, path, body, content
        self.lines: list[str] = []
        self.status: int | None = None
        self.error: BaseException | None = None
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        seen = 0
        try:
            with httpx.stream("POST", self.url + self.path, json=self.body, timeout=120) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    self.lines.append(line)
                    seen += self.content(line)
                    if seen >= EVENTS_BEFORE:
                        self.ready.set()
        except BaseException as e:  # noqa: BLE001 - what the client sees is the point
            self.error = e
        finally:
            self.ready.set()

    def events(self) -> list[tuple[str | None, str]]:
        self.thread.join(60)
        assert not self.thread.is_alive(), f"{self.path}: the stream did not end"
        assert self.error is None and self.status == 200, (self.path, self.status, self.error)
        return _sse(self.lines)


def _running(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    scraped = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}
    return sum(s.value for s in scraped["exllama:num_requests_running"].samples)


def test_an_engine_failure_mid_stream_ends_each_api_with_one_error_event(served):
    from exllama_integrations.serve.state import state_of

    rt, server = served
    url, model = server.url, rt.model_name
    state = state_of(server.app)
    said = [{"role": "user", "content": STORY}]
    readers = {
        "openai": Reader(
            url,
            "/v1/chat/completions",
            {"model": model, "messages": said, "max_tokens": 3000, "ignore_eos": True, "stream": True},
            lambda line: '"content":"' in line.replace(" ", "") and '"content":""' not in line.replace(" ", ""),
        ),
        "anthropic": Reader(
            url,
            "/v1/messages",
            {"model": model, "messages": said, "max_tokens": 3000, "stream": True},
            lambda line: line == "event: content_block_delta",
        ),
        "responses": Reader(
            url,
            "/v1/responses",
            {"model": model, "input": STORY, "max_output_tokens": 3000, "stream": True},
            lambda line: line == "event: response.output_text.delta",
        ),
    }
    for reader in readers.values():
        assert reader.ready.wait(120)
    assert all(not r.error and r.thread.is_alive() for r in readers.values()), {
        k: (r.error, r.lines[-3:]) for k, r in readers.items()
    }  # all three are still generating when the engine fails
    (pid,) = rt.diagnostics()["engine_pids"]
    os.kill(pid, signal.SIGKILL)

    # OpenAI: the chunks sent, then one data line holding an error object, then [DONE], then nothing
    events = readers["openai"].events()
    data = [d for _, d in events]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    errors = [c for c in chunks if "error" in c]
    assert len(errors) == 1 and chunks[-1] is errors[0], chunks[-3:]
    error = errors[0]["error"]
    assert error["code"] == "engine_unavailable" and error["type"] == "server_error" and error["message"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert sum(bool(c.get("choices") and c["choices"][0]["delta"].get("content")) for c in chunks) >= EVENTS_BEFORE
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks if c.get("choices"))  # no false ending

    # Anthropic: message_start and the deltas sent, then one `event: error`, then nothing (no message_stop)
    events = readers["anthropic"].events()
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names.count("content_block_delta") >= EVENTS_BEFORE
    assert names.count("error") == 1 and names[-1] == "error", names[-4:]
    assert "message_stop" not in names and "message_delta" not in names
    assert json.loads(events[-1][1]) == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": json.loads(events[-1][1])["error"]["message"]},
    }
    assert json.loads(events[-1][1])["error"]["message"]

    # Responses: response.created and the deltas sent, then one `error` event, then nothing (no response.completed)
    events = readers["responses"].events()
    names = [n for n, _ in events]
    payloads = [json.loads(d) for _, d in events]
    assert names[0] == "response.created" and names.count("response.output_text.delta") >= EVENTS_BEFORE
    assert names.count("error") == 1 and names[-1] == "error", names[-4:]
    assert not {"response.completed", "response.incomplete"} & set(names)
    assert all(p["type"] == n for n, p in zip(names, payloads))
    failure = payloads[-1]
    assert failure["code"] == "engine_unavailable" and failure["message"] and "param" in failure
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))

    # nothing is left counted: not in /metrics, not in the server's admission, not in the runtime
    t0 = time.perf_counter()
    while (state.pending or rt.active_requests) and time.perf_counter() - t0 < 10:
        time.sleep(0.05)
    assert state.pending == 0 and rt.active_requests == 0
    assert _running(url) == 0
