"""Anthropic's Messages API (``POST /v1/messages``) on the demo model, through the clients that speak it.

The ``anthropic`` client (whole and streamed, a tool round trip, thinking, stop sequences, token counting, keys,
Anthropic-shaped errors) and ``langchain_anthropic.ChatAnthropic(base_url=...)`` through LangChain's standard
integration suite. One server per shape, all over the one shared demo runtime (no model is loaded twice); the
standard suite's protocol tests on a server over the tiny random model (its _TRAINED tests on the demo model's).
"""

from __future__ import annotations

import json
from typing import Any, Literal

import anthropic
import httpx
import pytest
from langchain_anthropic import ChatAnthropic
from langchain_tests.integration_tests import ChatModelIntegrationTests
from pydantic import BaseModel
from servers import ThreadServer

from exllama_integrations.serve.app import ServeLimits

from helpers import THINKS

MODEL = "smollm2-demo"
KEY = "s3cret-key"
ADD = {
    "name": "add",
    "description": "Add two integers.",
    "input_schema": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
}
_servers: dict[str, ThreadServer] = {}


def _server(kind: str = "main") -> ThreadServer:
    """A server over the shared demo runtime (``tiny``: over the tiny random model with SmolLM2's tokenizer), started
    on first use (the standard suite's properties need it too)."""
    if kind not in _servers:
        from exllama_integrations import ExLlamaRuntime
        from exllama_integrations.demo_model import demo_model_dir

        from fixture_models import tiny_smollm2_dir

        model_dir = tiny_smollm2_dir() if kind == "tiny" else demo_model_dir()
        runtime = ExLlamaRuntime.shared(model_dir, "transformers")
        extra: dict[str, Any] = {
            "main": {},
            "tiny": {},
            "thinks": {"chat_template": THINKS},  # SmolLM2 "thinks" in a block its prompt opens
            "small": {"limits": ServeLimits(max_body_bytes=4096, max_pending=0)},
        }[kind]
        _servers[kind] = ThreadServer(runtime, served_model_name=MODEL, api_key=KEY, **extra)
    return _servers[kind]


def _client(kind: str = "main", **kw: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=_server(kind).url, api_key=KEY, max_retries=0, **kw)


GREEDY = {"extra_body": {"temperature": 0}}  # this SDK no longer types temperature; the API still takes it


def _create(client: anthropic.Anthropic, **kw: Any) -> Any:
    return client.messages.create(model=MODEL, **GREEDY, **kw)


def _events(kind: str = "main", **body: Any) -> list[tuple[str, dict]]:
    """A streamed request's events as (event name, data), read off the wire."""
    events = []
    with httpx.stream(
        "POST",
        _server(kind).url + "/v1/messages",
        json={"model": MODEL, "temperature": 0, "stream": True, **body},
        headers={"x-api-key": KEY},
        timeout=120,
    ) as r:
        assert r.status_code == 200, r.read()
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name  # Anthropic's events name themselves twice
                events.append((name, data))
    return events


def _check_sequence(events: list[tuple[str, dict]]) -> None:
    """message_start and ping, blocks opened, filled and closed in order, message_delta, message_stop."""
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    open_index = None
    seen = -1
    for name, data in events[2:-2]:
        if name == "content_block_start":
            assert open_index is None and data["index"] == seen + 1
            open_index = seen = data["index"]
        elif name == "content_block_delta":
            assert data["index"] == open_index
        else:
            assert name == "content_block_stop" and data["index"] == open_index
            open_index = None
    assert open_index is None and seen >= 0
    start, end = events[0][1]["message"]["usage"], events[-2][1]["usage"]
    split = ("input_tokens", "cache_read_input_tokens")
    assert [start[k] for k in split] == [end[k] for k in split], (start, end)  # the opening splits as the end


def _blocks(events: list[tuple[str, dict]]) -> list[dict]:
    """The content blocks a stream builds (what a client accumulates)."""
    blocks: list[dict] = []
    for name, data in events:
        if name == "content_block_start":
            blocks.append({**data["content_block"], "partial_json": ""})
        elif name == "content_block_delta":
            d, b = data["delta"], blocks[data["index"]]
            key = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}[d["type"]]
            b[key] += d["partial_json" if key == "partial_json" else key]
    return blocks


# --------------------------------------------------------------------------- the anthropic client


def test_create_whole_and_streamed_agree() -> None:
    client = _client("tiny")  # the protocol's shapes: no trained model's answer is needed
    msgs = [{"role": "user", "content": "Name a colour."}]
    whole = _create(client, max_tokens=12, messages=msgs, system=[{"type": "text", "text": "Answer briefly."}])
    assert whole.type == "message" and whole.role == "assistant" and whole.model == MODEL
    assert whole.id.startswith("msg_") and whole.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens > 0
    assert 0 < whole.usage.output_tokens <= 12

    events = _events("tiny", max_tokens=12, messages=msgs, system="Answer briefly.")
    _check_sequence(events)
    assert _blocks(events)[0]["text"] == whole.content[0].text  # greedy: the stream says what the whole answer says
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == whole.stop_reason
    assert delta["usage"]["output_tokens"] == whole.usage.output_tokens
    start = events[0][1]["message"]
    assert start["id"].startswith("msg_") and start["content"] == [] and start["usage"]["input_tokens"] > 0

    helper = client.messages.stream(model=MODEL, max_tokens=12, messages=msgs, system="Answer briefly.", **GREEDY)
    with helper as s:  # the SDK's own stream reader
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert final.content[0].text == text and final.usage.output_tokens == whole.usage.output_tokens


def test_stop_sequences_end_the_reply_and_are_named() -> None:
    client = _client()
    msgs = [{"role": "user", "content": "Count from one to ten in words."}]
    free = _create(client, max_tokens=16, messages=msgs).content[0].text
    assert len(free) >= 8, free
    stop = free[len(free) // 2 : len(free) // 2 + 3]  # greedy: the same reply again, until its first occurrence
    cut = _create(client, max_tokens=16, messages=msgs, stop_sequences=[stop, "never-written"])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == free[: free.index(stop)]


def test_tool_round_trip() -> None:
    client = _client()
    question = {"role": "user", "content": "What is 2 + 3? Use the tool."}
    forced = {"type": "tool", "name": "add", "disable_parallel_tool_use": True}
    call = _create(client, max_tokens=100, messages=[question], tools=[ADD], tool_choice=forced)
    uses = [b for b in call.content if b.type == "tool_use"]
    assert call.stop_reason == "tool_use" and len(uses) == 1, call
    use = uses[0]
    assert use.name == "add" and use.id.startswith("toolu_") and set(use.input) == {"a", "b"}

    streamed = _events(max_tokens=100, messages=[question], tools=[ADD], tool_choice=forced)
    _check_sequence(streamed)
    (streamed_use,) = [b for b in _blocks(streamed) if b["type"] == "tool_use"]
    assert streamed_use["name"] == "add" and json.loads(streamed_use["partial_json"]) == use.input
    assert streamed[-2][1]["delta"]["stop_reason"] == "tool_use"

    result = {"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": "5"}]}
    history = [question, {"role": "assistant", "content": call.content}, {"role": "user", "content": [result]}]
    answer = _create(client, max_tokens=24, messages=history, tools=[ADD])
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"

    failed = {**result, "content": "division by zero", "is_error": True}
    assert _create(client, max_tokens=4, messages=[*history[:2], {"role": "user", "content": [failed]}], tools=[ADD])

    stray = {**result, "tool_use_id": "toolu_not_a_call"}
    with pytest.raises(anthropic.BadRequestError) as e:
        _create(client, max_tokens=4, messages=[*history[:2], {"role": "user", "content": [stray]}], tools=[ADD])
    assert "toolu_not_a_call" in e.value.body["error"]["message"] and e.value.body["error"]["type"] == (
        "invalid_request_error"
    )


def test_thinking_is_accepted_and_comes_back_as_a_block() -> None:
    # SmolLM2's own template does not reason: thinking settings are accepted and change nothing visible
    plain = _client()
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    for thinking in ({"type": "enabled", "budget_tokens": 8}, {"type": "disabled"}):
        reply = _create(plain, max_tokens=8, messages=msgs, thinking=thinking)
        assert [b.type for b in reply.content] == ["text"]

    # with a template that opens a thinking block, the thinking is a block of its own, bounded by the budget
    thinks = _client("thinks")
    reply = _create(thinks, max_tokens=24, messages=msgs, thinking={"type": "enabled", "budget_tokens": 8})
    assert reply.content[0].type == "thinking" and reply.content[0].thinking
    assert all(b.type != "thinking" for b in reply.content[1:])
    events = _events("thinks", max_tokens=24, messages=msgs, thinking={"type": "enabled", "budget_tokens": 8})
    _check_sequence(events)
    blocks = _blocks(events)
    assert blocks[0]["type"] == "thinking" and blocks[0]["thinking"] == reply.content[0].thinking
    # the thinking given back in history is taken
    again = [*msgs, {"role": "assistant", "content": reply.content}, {"role": "user", "content": "And 3 + 3?"}]
    assert _create(thinks, max_tokens=4, messages=again).content


class Verdict(BaseModel):
    """A yes/no answer (enums: the demo model cannot loop inside one)."""

    answer: Literal["yes", "no"]
    sure: Literal["very", "somewhat", "not"]


def test_structured_output_config_is_honoured_by_the_sdk_parse_and_langchain() -> None:
    """``output_config.format`` (the anthropic SDK's ``messages.parse``; LangChain's ``with_structured_output(...,
    method="json_schema")``) holds the reply to the schema with the grammar; ``output_config.effort`` is accepted."""
    msgs = [{"role": "user", "content": "Is Paris in France?"}]
    parsed = _client().messages.parse(model=MODEL, max_tokens=40, messages=msgs, output_format=Verdict, **GREEDY)
    assert isinstance(parsed.parsed_output, Verdict) and parsed.stop_reason == "end_turn"
    raw = {"format": {"type": "json_schema", "schema": Verdict.model_json_schema()}, "effort": "low"}
    whole = _create(_client(), max_tokens=40, messages=msgs, output_config=raw)
    assert Verdict.model_validate_json(whole.content[0].text)
    chat = ChatAnthropic(model=MODEL, base_url=_server().url, api_key=KEY, max_tokens=40, temperature=0, max_retries=0)
    assert isinstance(chat.with_structured_output(Verdict, method="json_schema").invoke(msgs[0]["content"]), Verdict)
    counted = _client().messages.count_tokens(model=MODEL, messages=msgs, output_config=raw)
    assert counted.input_tokens > _client().messages.count_tokens(model=MODEL, messages=msgs).input_tokens


def test_count_tokens_matches_the_prompt_a_reply_reads() -> None:
    client = _client()
    msgs = [{"role": "user", "content": "Name a fruit."}]
    counted = client.messages.count_tokens(model=MODEL, messages=msgs, system="Be brief.", tools=[ADD])
    reply = _create(client, max_tokens=2, messages=msgs, system="Be brief.", tools=[ADD])
    assert counted.input_tokens == reply.usage.input_tokens + reply.usage.cache_read_input_tokens > 0


def test_keys_in_either_header() -> None:
    url = _server().url
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    refused = httpx.post(url + "/v1/messages", json=body)
    assert refused.status_code == 401
    assert refused.json() == {
        "type": "error",
        "error": {"type": "authentication_error", "message": refused.json()["error"]["message"]},
    }
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(model=MODEL, **body_of(body))
    bearer = anthropic.Anthropic(base_url=url, auth_token=KEY, max_retries=0)  # Authorization: Bearer
    assert bearer.messages.create(model=MODEL, **body_of(body)).content
    # the OpenAI endpoints keep their check: a wrong bearer token is refused even beside the right x-api-key
    assert httpx.get(url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    wrong = httpx.get(url + "/v1/models", headers={"authorization": "Bearer nope", "x-api-key": KEY})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/v1/models", headers={"x-api-key": "nope"}).status_code == 401


def body_of(body: dict) -> dict:
    return {k: v for k, v in body.items() if k != "model"}


def test_errors_in_anthropic_shape() -> None:
    client = _client()
    msgs = [{"role": "user", "content": "hi"}]

    def error_of(exc: type[Exception], **kw: Any) -> dict:
        with pytest.raises(exc) as e:
            client.messages.create(**{"model": MODEL, "messages": msgs, "max_tokens": 4, **kw})
        body = e.value.body  # type: ignore[attr-defined]
        assert set(body) >= {"type", "error"} and body["type"] == "error"
        return body["error"]

    typo = error_of(anthropic.BadRequestError, extra_body={"max_token": 3})
    assert typo["type"] == "invalid_request_error" and "did you mean 'max_tokens'" in typo["message"]
    missing = httpx.post(
        _server().url + "/v1/messages", json={"model": MODEL, "messages": msgs}, headers={"x-api-key": KEY}
    )
    assert missing.status_code == 400 and "max_tokens: Field required" in missing.json()["error"]["message"]
    assert error_of(anthropic.NotFoundError, model="not-served")["type"] == "not_found_error"
    assert (
        "tool_choice"
        in error_of(anthropic.BadRequestError, tools=[ADD], tool_choice={"type": "tool", "name": "x"})["message"]
    )
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _PNG}}
    no_images = error_of(anthropic.BadRequestError, messages=[{"role": "user", "content": [image]}])
    assert "takes no images" in no_images["message"]  # read through the image path, refused by a text model
    url_image = {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}
    assert (  # a text model refuses an image URL before anything would fetch it (issue 49)
        "takes no images"
        in error_of(anthropic.BadRequestError, messages=[{"role": "user", "content": [url_image]}])["message"]
    )
    gone = httpx.post(_server().url + "/v1/messages/batches", json={}, headers={"x-api-key": KEY})
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "not_found_error"

    from exllama_integrations.serve.anthropic.errors import typed_response

    crash = typed_response(RuntimeError("a bug"))  # what any untyped failure of a route is answered with
    assert crash.status_code == 500 and json.loads(crash.body)["error"]["type"] == "api_error"

    small = _client("small")
    with pytest.raises(anthropic.APIStatusError) as e:
        small.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "x" * 5000}])
    assert e.value.status_code == 413 and e.value.body["error"]["type"] == "request_too_large"
    with pytest.raises(anthropic.APIStatusError) as e:  # the server is full (max_pending=0)
        small.messages.create(model=MODEL, max_tokens=1, messages=msgs)
    assert e.value.status_code == 529 and e.value.body["error"]["type"] == "overloaded_error"


_PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="


# --------------------------------------------------------------------------- LangChain's standard suite


_TRAINED = {"test_tool_calling", "test_tool_calling_async", "test_tool_calling_with_no_arguments"}
"""The suite's tests whose tool call a random model never ends (as ChatExLlama's suite's TRAINED): on the demo model's
server. The others check the protocol (streaming, usage, stop, forced choice, tool histories, Anthropic's inputs), on
a server over SmolLM2's tokenizer and a tiny random model (~20x faster)."""


class TestChatAnthropicOnMessagesAPI(ChatModelIntegrationTests):
    """``ChatAnthropic(base_url=<our server>)``: LangChain's own suite against ``/v1/messages``, its streaming and
    tool-calling tests (the rest of the suite checks LangChain's side, run on this server by the ChatOpenAI and
    ChatExLlama suites)."""

    standard_tests_only = (
        frozenset(
            {
                "test_no_overrides_DO_NOT_OVERRIDE",
                "test_invoke",
                "test_stream",
                "test_astream",
                "test_usage_metadata",
                "test_usage_metadata_streaming",
                "test_stop_sequence",
                "test_tool_calling",
                "test_tool_calling_async",
                "test_tool_choice",
                "test_tool_calling_with_no_arguments",
                "test_tool_message_histories_string_content",
                "test_tool_message_histories_list_content",
                "test_tool_message_error_status",
                "test_anthropic_inputs",
            }
        ),
        "the Messages API suite runs its streaming and tool-calling tests; the rest checks LangChain's side, "
        "run on this server by the ChatOpenAI and ChatExLlama suites",
    )

    @pytest.fixture
    def model(self, request: pytest.FixtureRequest) -> ChatAnthropic:
        """The suite's ``model`` fixture, on the demo model's server for the tests in _TRAINED."""
        params = self.chat_model_params
        if request.node.originalname in _TRAINED:
            params = {**params, "base_url": _server().url}
        extra = getattr(request, "param", None) or {}
        return self.chat_model_class(**{**self.standard_chat_model_params, **params, **extra})

    @property
    def chat_model_class(self) -> type[ChatAnthropic]:
        return ChatAnthropic

    @property
    def chat_model_params(self) -> dict:
        # 48 tokens: a whole tool call, a short answer; the suite's own 100 doubles the time of every test
        return {"model": MODEL, "base_url": _server("tiny").url, "api_key": KEY, "temperature": 0, "max_tokens": 48}

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return False

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supports_anthropic_inputs(self) -> bool:
        return True
