"""``max_tool_calls`` (the Responses API) bounds what the model writes under a forced call, not only what is handed out.

With ``tool_choice`` forcing calls and ``parallel_tool_calls`` on, the forced grammar lets a family write several
calls; the demo model, served in the Hermes format, writes four calls to the question below when nothing bounds it.
With ``max_tool_calls`` the reply holds at most that many, and generation ends after the last one: its output
tokens are those of the calls handed out, not of calls nobody receives. Whole and streamed, on the real backend
(the claim in docs/serving-apis.md).
"""

from __future__ import annotations

import json

import httpx
import pytest

from exllama_integrations.chat.formats import FORMATS
from exllama_integrations.chat.formats.grammar import write_calls

pytestmark = pytest.mark.slow

TOOL = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ASK = {
    "input": "What is the weather in Paris, Rome, Tokyo and Berlin? Call get_weather once for each city.",
    "tools": [TOOL],
    "tool_choice": "required",
    "parallel_tool_calls": True,
    "max_output_tokens": 200,
    "temperature": 0,
}


@pytest.fixture(scope="module")
def url(demo_runtime):
    from servers import ThreadServer

    server = ThreadServer(demo_runtime, tool_format="hermes")  # a family that writes several calls
    try:
        yield server.url
    finally:
        server.stop()


def _written_tokens(runtime, calls: list[dict]) -> int:
    """Tokens of ``calls`` as the Hermes grammar writes them (the model's end of turn after them included)."""
    text = write_calls(FORMATS["hermes"], [(c["name"], json.loads(c["arguments"])) for c in calls])
    return len(runtime.encode(text, add_special_tokens=False)) + 1


def test_the_forced_grammar_stops_at_max_tool_calls(url, demo_runtime):
    reply = httpx.post(url + "/v1/responses", json={**ASK, "max_tool_calls": 1}, timeout=300)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    calls = [i for i in body["output"] if i["type"] == "function_call"]
    assert len(calls) == 1, body["output"]
    first = calls[0]["arguments"]
    assert body["status"] == "completed" and body["max_tool_calls"] == 1
    # the model wrote the one call and ended its turn: no tokens spent on calls that were then dropped
    assert body["usage"]["output_tokens"] <= _written_tokens(demo_runtime, calls) + 2, body["usage"]

    streamed = {**ASK, "max_tool_calls": 2, "stream": True}
    with httpx.stream("POST", url + "/v1/responses", json=streamed, timeout=300) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    done = events[-1]
    assert done["type"] == "response.completed"
    calls = [i for i in done["response"]["output"] if i["type"] == "function_call"]
    assert [i["type"] for i in added] == ["function_call", "function_call"] and len(calls) == 2, added
    assert calls[0]["arguments"] == first  # greedy: the same start as the one-call reply
    assert done["response"]["usage"]["output_tokens"] <= _written_tokens(demo_runtime, calls) + 2
