"""OpenAI's conventions at the server, as its clients rely on them (issue 33, items 4-7), on the shared demo server.

A body that fails validation is a 400 naming the field (not FastAPI's 422); the fields OpenAI documents and we do
not use are accepted; legacy ``functions`` are tools; ``n`` choices; ``echo`` + ``logprobs`` score a prompt, a list
of prompts is answered as one batch (what lm-evaluation-harness's ``local-completions`` sends);
``max_reasoning_tokens`` is a request field; ``/tokenizer_info`` speaks vLLM's shape.
"""

from __future__ import annotations

import json

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
        "prompt_cache_retention": "24h",  # the OpenAI Agents SDK sends it (accepted on Responses too)
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
    from exllama_integrations.serve.conversion import ChatContext
    from exllama_integrations.serve.openai.convert import to_chat
    from exllama_integrations.serve.openai.protocol.chat import ChatCompletionRequest

    def kwargs(effort: str, switch: bool) -> dict:
        body = ChatCompletionRequest(messages=HI, reasoning_effort=effort)
        return dict(to_chat(body, ChatContext(GenerationSettings(), thinking_switch=switch)).template_kwargs)

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


# ----------------------------------------------------------------------------- items 4 and 5: choices, scoring


def test_echo_with_logprobs_scores_the_prompt_as_the_model_does(url, demo_runtime):
    prompt = "The capital of France is Paris"
    body = {"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 0, "temperature": 0}
    r = _post(url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    lp = choice["logprobs"]
    ids = demo_runtime.encode(prompt, add_special_tokens=True)
    assert choice["text"] == prompt and usage == {**usage, "prompt_tokens": len(ids), "completion_tokens": 0}
    assert len(lp["tokens"]) == len(ids) and "".join(lp["tokens"]) == prompt
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(ids))]
    oracle = _prompt_logprobs(demo_runtime, ids)
    assert lp["token_logprobs"][1:] == pytest.approx(oracle, abs=1e-3)
    tops = lp["top_logprobs"][1:]
    chosen = lp["token_logprobs"][1:]
    assert all(len(top) in (2, 3) and max(top.values()) >= chosen[i] - 1e-6 for i, top in enumerate(tops))
    assert all(top[lp["tokens"][i + 1]] == lp["token_logprobs"][i + 1] for i, top in enumerate(tops))  # chosen too
    one = _post(url, "/v1/completions", {**body, "max_tokens": 1})  # lm-eval's form: the generated token appended
    lp1 = one.json()["choices"][0]["logprobs"]
    assert len(lp1["tokens"]) == len(ids) + 1 and lp1["token_logprobs"][1:-1] == pytest.approx(oracle, abs=1e-3)


def _prompt_logprobs(runtime, ids: list[int]) -> list[float]:
    """transformers' own log-softmax over the demo model's logits: the oracle of a prompt's scores."""
    import torch

    model = runtime.diagnostics()["model"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]


def test_a_list_of_prompts_and_n_choices_answer_in_one_response(url):
    body = {"prompt": ["The sky is", "One, two,"], "n": 2, "max_tokens": 3, "temperature": 0}
    r = _post(url, "/v1/completions", body).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    alone = [_post(url, "/v1/completions", {**body, "prompt": p, "n": 1}).json() for p in body["prompt"]]
    texts = [c["text"] for c in r["choices"]]
    assert texts == [alone[0]["choices"][0]["text"]] * 2 + [alone[1]["choices"][0]["text"]] * 2  # greedy: equal
    assert r["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)  # each prompt once
    assert r["usage"]["completion_tokens"] == sum(2 * a["usage"]["completion_tokens"] for a in alone)  # every choice


def test_n_choices_are_sampled_apart_and_stream_with_their_index(url):
    body = {"prompt": "Once upon a time", "n": 3, "max_tokens": 8, "temperature": 1.0, "seed": 7, "stream": True}
    body["stream_options"] = {"include_usage": True}
    texts, usage = {0: "", 1: "", 2: ""}, None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                for c in event["choices"]:
                    texts[c["index"]] += c["text"]
                usage = event.get("usage") or usage
    assert len(set(texts.values())) > 1  # three samples, not one answer three times
    assert usage["completion_tokens"] == 24 and usage["prompt_tokens"] < 24 / 3 + 8
    whole = _post(url, "/v1/completions", {**body, "stream": False}).json()
    assert [c["text"] for c in whole["choices"]] == [texts[i] for i in range(3)]  # seeded: the same three samples


def test_n_chat_choices_carry_their_index_and_summed_usage(url):
    body = {"messages": HI, "n": 2, "max_tokens": 4, "temperature": 0}
    r = _post(url, "/v1/chat/completions", body).json()
    one = _post(url, "/v1/chat/completions", {**body, "n": 1}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in r["choices"]] == [one["choices"][0]["message"]["content"]] * 2
    assert r["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert r["usage"]["completion_tokens"] == 2 * one["usage"]["completion_tokens"]
    texts, usage = {0: "", 1: ""}, None
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=stream, timeout=120) as events:
        for line in events.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                for c in event["choices"]:
                    texts[c["index"]] += c["delta"].get("content") or ""
                usage = event.get("usage") or usage
    assert list(texts.values()) == [c["message"]["content"] for c in r["choices"]]
    assert usage["completion_tokens"] == r["usage"]["completion_tokens"]


def test_lm_eval_local_completions_scores_a_multiple_choice_task(url, tmp_path, monkeypatch):
    from pathlib import Path

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # before datasets is imported: it reads them once
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    data = Path(__file__).parent.parent / "data" / "lm_eval"
    (tmp_path / "tiny_capitals.yaml").write_text(
        (data / "tiny_capitals.yaml").read_text().replace("DATA_FILE", str(data / "tiny_capitals.jsonl"))
    )
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": url + "/v1/completions", "model": MODEL, "tokenizer_backend": "remote"},
        tasks=["tiny_capitals"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),  # not its 10,000 task files
        batch_size=2,
    )
    acc = out["results"]["tiny_capitals"]["acc,none"]
    assert 0.0 <= acc <= 1.0 and out["n-samples"]["tiny_capitals"]["effective"] == 4


def test_a_prompts_scores_cross_the_engine_wire():
    from exllama_integrations.backends.base import RawLogprob, TokenStep
    from exllama_integrations.runtime.engine.wire import step_from_wire, step_to_wire

    scored = (RawLogprob(5, 0.0), RawLogprob(7, -1.5, ((7, -1.5), (9, -2.0))))
    step = TokenStep((3,), None, None, prompt_logprobs=scored)
    assert step_from_wire(step_to_wire(1, step, "transformers")) == (1, step)
    plain = TokenStep((3,), None, "length")
    assert step_from_wire(step_to_wire(2, plain, "transformers")) == (2, plain)


def test_backends_that_cannot_score_a_prompt_refuse_it_typed():
    from exllama_integrations import GenerationSettings
    from exllama_integrations.backends.exllamav3.backend import ExLlamaV3Backend
    from exllama_integrations.contract.settings import check_supported
    from exllama_integrations.errors import InvalidSettingsError

    with pytest.raises(InvalidSettingsError, match="transformers"):
        check_supported(GenerationSettings(prompt_logprobs=1), ExLlamaV3Backend.unsupported_settings)
