"""OpenAI's conventions at the server, as its clients rely on them (issue 33, items 4-7), on the shared demo server.

A body that fails validation is a 400 naming the field (not FastAPI's 422); the fields OpenAI documents and we do
not use are accepted; legacy ``functions`` are tools; ``n`` choices; ``echo`` + ``logprobs`` score a prompt, a list
of prompts is answered as one batch (what lm-evaluation-harness's ``local-completions`` sends);
``max_reasoning_tokens`` is a request field; ``/tokenizer_info`` speaks vLLM's shape.
"""

from __future__ import annotations

import httpx
import pytest
from servers import demo_server

MODEL = "SmolLM2-135M-Instruct"
HI = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def url(demo_dir) -> str:
    return demo_server()


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


# ----------------------------------------------------------------------------- item 6: bad and unknown input


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": HI, "temprature": 0}, "temprature"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ("/v1/chat/completions", {"messages": HI, "modalities": ["text", "video"]}, "modalities.1"),
        ("/tokenize", {"prompt": "x", "extra": 1}, "extra"),
    ],
    ids=["too-short", "unknown", "wrong-type", "bad-literal", "tokenize"],
)
def test_a_body_that_fails_validation_is_a_400_naming_the_field(url, path, body, param):
    r = _post(url, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_an_unknown_field_keeps_its_did_you_mean(url):
    r = _post(url, "/v1/chat/completions", {"messages": HI, "max_tokenz": 3})
    assert r.status_code == 400 and "did you mean 'max_tokens'" in r.json()["error"]["message"]


def test_documented_openai_fields_are_accepted(url):
    body = {
        "model": MODEL,
        "messages": [
            *HI,
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "I will not."}]},
            {"role": "user", "content": "Say hi again."},
        ],
        "max_tokens": 2,
        "temperature": 0,
        "prompt_cache_key": "k1",
        "safety_identifier": "u-hash",
        "user": "someone",
        "metadata": {"run": "1"},
        "store": False,
        "modalities": ["text"],
        "verbosity": "low",
        "service_tier": "auto",
        "reasoning_effort": "low",
        "parallel_tool_calls": False,
        "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False},
    }
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [x for x in r.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and '"usage"' in lines[-2]
    done = _post(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "user": "u", "prompt_cache_key": "k"})
    assert done.status_code == 200, done.text


def test_audio_is_refused_typed(url):
    r = _post(url, "/v1/chat/completions", {"messages": HI, "modalities": ["text", "audio"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "modalities"


def test_legacy_functions_are_tools(url):
    fn = {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
    body = {
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "functions": [fn],
        "function_call": {"name": "get_weather"},
        "max_tokens": 40,
        "temperature": 0,
    }
    r = _post(url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert calls and calls[0]["function"]["name"] == "get_weather"
    history = [
        *body["messages"],
        {"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": '{"city": "P"}'}},
        {"role": "function", "name": "get_weather", "content": "sunny"},
    ]
    again = _post(url, "/v1/chat/completions", {"messages": history, "functions": [fn], "max_tokens": 2})
    assert again.status_code == 200, again.text


def test_reasoning_effort_sets_the_templates_thinking_switch():
    from exllama_integrations import GenerationSettings
    from exllama_integrations.serve.openai.protocol.chat import ChatCompletionRequest

    def kwargs(effort: str, switch: bool) -> dict:
        body = ChatCompletionRequest(messages=HI, reasoning_effort=effort)
        return dict(body.to_chat(GenerationSettings(), {}, thinking_switch=switch).template_kwargs)

    assert kwargs("none", True) == {"reasoning_effort": "none", "enable_thinking": False}
    assert kwargs("high", True) == {"reasoning_effort": "high", "enable_thinking": True}
    assert kwargs("low", False) == {"reasoning_effort": "low"}  # no switch: the template reads the effort itself


# ----------------------------------------------------------------------------- item 7: reasoning budget, tokenizer


def test_max_reasoning_tokens_is_a_request_field(url):
    body = {"messages": HI, "max_tokens": 2, "max_reasoning_tokens": 8}
    assert _post(url, "/v1/chat/completions", body).status_code == 200
    both = _post(url, "/v1/completions", {"prompt": "x", "max_reasoning_tokens": 8, "thinking_token_budget": 8})
    assert both.status_code == 400 and both.json()["error"]["code"] == "duplicate_setting"


def test_tokenizer_info_speaks_vllms_shape(url, demo_runtime):
    info = httpx.get(url + "/tokenizer_info", timeout=30).json()
    assert info["tokenizer_class"] and info["model_max_length"] == demo_runtime.model_info().context_length
    eos = demo_runtime.model_info().eos_token_ids[0]
    assert demo_runtime.encode(info["eos_token"]) == [eos]
    assert info["chat_template"] == demo_runtime.tokenizer.chat_template
    assert not {"vocab_file", "merges_file", "tokenizer_file"} & set(info)
    assert all(isinstance(v, str) for v in info.get("added_tokens_decoder", {}).values())
