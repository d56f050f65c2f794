"""One behaviour, decided once: LangChain and LlamaIndex agree, over every Runtime implementation.

Each test runs for both frameworks and for three runtimes: in process, a thread proxy (a second,
minimal implementation of the contract, tests/proxy_runtime.py) and a real server (RemoteRuntime).
"""

from __future__ import annotations

import pytest
from llama_index.core.base.llms.types import ChatMessage
from proxy_runtime import ThreadProxyRuntime

from exllama_integrations import ConstraintViolationError, ExLlamaRuntime, InvalidSettingsError
from exllama_integrations.chat.prepare import ChatRequest, prepare_chat

from helpers import ADD_TOOL as ADD

Q = "What is the capital of France?"


@pytest.fixture(scope="module", params=["local", "proxy", "remote"])
def runtime(request, demo_dir):
    local = ExLlamaRuntime.shared(demo_dir, "transformers")
    if request.param == "local":
        return local
    if request.param == "proxy":
        return ThreadProxyRuntime(local)
    from servers import demo_server

    from exllama_integrations.runtime.remote import RemoteRuntime

    return RemoteRuntime.shared(demo_server())


class LangChainChat:
    def __init__(self, runtime, **kw):
        from exllama_integrations.langchain import ChatExLlama

        self.model = ChatExLlama(runtime=runtime, **kw)

    def chat(self, text, tools=None, tool_choice=None, **kw):
        model = self.model.bind_tools(tools, tool_choice=tool_choice) if tools else self.model
        chunks = list(model.stream(text, **kw))
        full = chunks[0]
        for c in chunks[1:]:
            full = full + c
        calls = [(c["name"], c["args"]) for c in full.tool_calls]
        return [c.content for c in chunks[:-1]], full.content, calls, full.response_metadata


class LlamaIndexChat:
    def __init__(self, runtime, **kw):
        from exllama_integrations.llama_index import ExLlamaLLM

        if "max_tokens" in kw:
            kw["max_new_tokens"] = kw.pop("max_tokens")
        self.model = ExLlamaLLM(runtime=runtime, **kw)

    def chat(self, text, tools=None, tool_choice=None, **kw):
        import json

        extra = {"tools": tools, "tool_choice": tool_choice} if tools else {}
        responses = list(self.model.stream_chat([ChatMessage(role="user", content=text)], **extra, **kw))
        last = responses[-1]
        calls = [
            (c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in last.message.additional_kwargs.get("tool_calls", [])
        ]
        return [r.delta for r in responses[:-1]], last.message.content, calls, last.raw


@pytest.fixture(params=[LangChainChat, LlamaIndexChat], ids=["langchain", "llama_index"])
def framework(request):
    return request.param


def test_finish_reasons_and_usage_are_the_same(framework, runtime):
    chat = framework(runtime, temperature=0, max_tokens=40)
    deltas, content, _, md = chat.chat(Q)
    assert "Paris" in content and content.startswith("".join(deltas)) and deltas
    assert (md["finish_reason"], md["native_finish_reason"]) == ("stop", "eos")
    prompt = prepare_chat(runtime, ChatRequest([{"role": "user", "content": Q}])).prompt
    assert md["usage"]["prompt_tokens"] == len(runtime.encode(prompt))
    assert md["usage"]["total_tokens"] == md["usage"]["prompt_tokens"] + md["usage"]["completion_tokens"]
    assert md["backend"] == "transformers" and md["model_name"] == "SmolLM2-135M-Instruct"
    _, _, _, md = chat.chat(Q, max_tokens=3)
    assert (md["finish_reason"], md["native_finish_reason"], md["usage"]["completion_tokens"]) == (
        "length",
        "length",
        3,
    )
    _, cut, _, md = chat.chat(Q, stop=[" Paris"])
    assert (md["finish_reason"], md["native_finish_reason"], md["stop_string"]) == ("stop", "stop", " Paris")
    assert content.startswith(cut) and " Paris" not in cut


def test_forced_tool_calls_hold_the_tag_back_and_finish_as_tool_calls(framework, runtime):
    chat = framework(runtime, temperature=0, max_tokens=60)
    deltas, content, calls, md = chat.chat("What is 2 + 3?", tools=[ADD], tool_choice="add")
    assert calls == [("add", {"a": 2, "b": 3})]
    assert not any("<tool" in d or "tool_call" in d for d in deltas)  # never streamed as text
    assert "<tool_call>" not in content and md["finish_reason"] == "tool_calls"


def test_logprobs_have_one_shape(framework, runtime):
    chat = framework(runtime, temperature=0, max_tokens=3)
    _, _, _, md = chat.chat("Say yes.", logprobs=True, top_logprobs=2)
    # LangChain concatenates the streamed logprobs; LlamaIndex gives them on its responses
    if framework is LangChainChat:
        content = md["logprobs"]["content"]
        assert 1 <= len(content) <= 3
        assert all(e["logprob"] <= 0 and len(e["top_logprobs"]) == 2 and isinstance(e["token"], str) for e in content)
    else:
        r = chat.model.chat([ChatMessage(role="user", content="Say yes.")], logprobs=True, top_logprobs=2)
        assert r.logprobs and all(len(tok) == 2 and tok[0].logprob <= 0 for tok in r.logprobs)


def test_unknown_arguments_are_refused_alike(framework, runtime):
    chat = framework(runtime, temperature=0, max_tokens=3)
    with pytest.raises(InvalidSettingsError, match="did you mean 'temperature'"):
        chat.chat(Q, temprature=0.5)
    with pytest.raises(InvalidSettingsError, match="did you mean 'temperature'"):
        framework(runtime, temprature=0.5)


def test_a_constrained_reply_cut_short_raises_alike(framework, runtime):
    chat = framework(runtime, temperature=0, max_tokens=4)
    with pytest.raises(ConstraintViolationError, match="raise max_tokens"):
        chat.chat("What is 2 + 3?", tools=[ADD], tool_choice="add")


def test_completion_metadata_is_the_same_for_one_prompt_a_batch_and_llama_index(runtime):
    from exllama_integrations.langchain import ExLlamaLLM
    from exllama_integrations.llama_index import ExLlamaLLM as LI

    llm = ExLlamaLLM(runtime=runtime, temperature=0, max_new_tokens=6)
    one = llm.generate(["The sky is"], logprobs=True).generations[0][0]
    two = llm.generate(["The sky is", "One, two,"], logprobs=True).generations[0][0]
    assert one.text == two.text
    assert set(one.generation_info) == set(two.generation_info)
    timing = {"time_to_first_token", "tokens_per_second"}
    assert {k: v for k, v in one.generation_info.items() if k not in timing} == {
        k: v for k, v in two.generation_info.items() if k not in timing
    }
    raw = LI(runtime=runtime, temperature=0, max_new_tokens=6).complete("The sky is").raw
    assert set(raw) == set(one.generation_info) - {"logprobs"}
    assert raw["usage"] == one.generation_info["usage"]
