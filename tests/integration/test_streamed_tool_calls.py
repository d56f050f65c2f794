"""A streamed tool call reads as OpenAI streams it, through the openai SDK's ``chat.completions.stream()`` helper.

OpenAI sends a call's ``id``, ``type`` and name with its first delta only; the deltas after carry ``index`` and more
``function.arguments``, nothing else. The SDK's stream helper merges each delta into the call it builds, so a
continuation delta that writes ``"type": null`` overwrites the call's type and the helper fails
(``assert new_tool.type == "function"``). On the shared demo server, with a forced call.
"""

from __future__ import annotations

import json

import httpx
import pytest
from servers import demo_server

from helpers import ADD_TOOL

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def url(demo_dir) -> str:
    return demo_server()


def test_the_openai_sdk_stream_helper_reads_a_streamed_tool_call(url):
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    with client.chat.completions.stream(
        model=MODEL, messages=ASK, tools=[ADD_TOOL], tool_choice="required", temperature=0, max_tokens=60
    ) as stream:
        deltas = [e.arguments_delta for e in stream if e.type == "tool_calls.function.arguments.delta"]
        done = stream.get_final_completion()
    call = done.choices[0].message.tool_calls[0]
    assert call.type == "function" and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
    assert len(deltas) > 1 and "".join(deltas) == call.function.arguments  # the arguments streamed in pieces
    assert done.choices[0].finish_reason == "tool_calls"


def test_a_continuation_delta_carries_only_its_index_and_arguments(url):
    body = {"model": MODEL, "messages": ASK, "tools": [ADD_TOOL], "tool_choice": "required", "temperature": 0}
    calls = []
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                for choice in event["choices"]:
                    calls += choice["delta"].get("tool_calls") or []
    first, *rest = calls
    assert first["id"] and first["type"] == "function" and first["function"]["name"] == "add"
    assert rest and all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in rest), rest
