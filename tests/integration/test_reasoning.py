"""Reasoning, decided once for every door: thinking apart from the answer, a budget, grammars after thinking.

SmolLM2 does not reason, but given a chat template whose generation prompt opens a thinking block (as
DeepSeek-R1's does) it writes its thoughts there, and the budget and the constraint rule are exercised on a
real model. Each behaviour is asserted through LangChain, LlamaIndex and the server (the ``openai`` client),
which read it from one place (the runtime splits the text; the chat layer places the grammar).
"""

from __future__ import annotations

import json

import pytest
from arch_models import QWEN3
from pydantic import BaseModel
from servers import ThreadServer

from exllama_integrations import ConstraintViolationError, ExLlamaRuntime

from helpers import THINKS

KEEPS = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m.get('reasoning_content') %}<think>\n"
    "{{ m['reasoning_content'] }}\n</think>\n{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
"""A template that keeps an earlier turn's thinking in the history."""
Q = "What is the capital of France?"
END_TOKENS = 3  # "</think>" in SmolLM2's tokenizer


class City(BaseModel):
    name: str
    country: str


@pytest.fixture(scope="module")
def server(demo_runtime):
    s = ThreadServer(demo_runtime, chat_template=THINKS)
    yield s
    s.stop()


class LangChainDoor:
    def __init__(self, demo_dir, **kw):
        from exllama_integrations.langchain import ChatExLlama

        self.model = ChatExLlama(model_dir=str(demo_dir), backend="transformers", temperature=0, **kw)

    def ask(self, text=Q, **kw):
        msg = self.model.invoke(text, **kw)
        details = msg.usage_metadata["output_token_details"]
        assert msg.content_blocks[0] == {"type": "reasoning", "reasoning": msg.additional_kwargs["reasoning_content"]}
        return msg.content, msg.additional_kwargs.get("reasoning_content", ""), details["reasoning"]

    def stream(self, text=Q, **kw):
        chunks = list(self.model.stream(text, **kw))
        return "".join(c.content for c in chunks), "".join(
            c.additional_kwargs.get("reasoning_content", "") for c in chunks
        )


class LlamaIndexDoor:
    def __init__(self, demo_dir, **kw):
        from exllama_integrations.llama_index import ExLlamaLLM

        if "max_tokens" in kw:
            kw["max_new_tokens"] = kw.pop("max_tokens")
        self.model = ExLlamaLLM(model_dir=str(demo_dir), backend="transformers", temperature=0, **kw)

    def ask(self, text=Q, **kw):
        from llama_index.core.base.llms.types import ChatMessage

        r = self.model.chat([ChatMessage(role="user", content=text)], **kw)
        thinking = [b for b in r.message.blocks if b.block_type == "thinking"]
        tokens = r.raw["usage"]["completion_tokens_details"]["reasoning_tokens"]
        assert thinking and thinking[0].num_tokens == tokens
        return r.message.content, thinking[0].content, tokens

    def stream(self, text=Q, **kw):
        from llama_index.core.base.llms.types import ChatMessage

        rs = list(self.model.stream_chat([ChatMessage(role="user", content=text)], **kw))
        return rs[-1].message.content, "".join(r.additional_kwargs.get("thinking_delta", "") for r in rs)


class ServerDoor:
    """The OpenAI endpoint through the ``openai`` client, the template set with ``serve --chat-template``."""

    def __init__(self, url, **kw):
        import openai

        self.client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        self.kw = {"max_tokens": kw.get("max_tokens", 60), "temperature": 0}
        if kw.get("max_reasoning_tokens"):
            self.kw["extra_body"] = {"thinking_token_budget": kw["max_reasoning_tokens"]}

    def ask(self, text=Q, **kw):
        r = self.client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": text}], **self.kw
        )
        m = r.choices[0].message
        assert m.model_extra["reasoning"] == m.model_extra["reasoning_content"]  # vLLM's newer name too
        return m.content, m.model_extra["reasoning_content"], r.usage.completion_tokens_details.reasoning_tokens

    def stream(self, text=Q, **kw):
        events = self.client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": text}], stream=True, **self.kw
        )
        content, thought = "", ""
        for e in events:
            if e.choices:
                content += e.choices[0].delta.content or ""
                thought += (e.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
        return content, thought


DOORS = ["langchain", "llama_index", "server"]


def _door(kind, demo_dir, server, **kw):
    if kind == "server":
        return ServerDoor(server.url, **kw)
    cls = LangChainDoor if kind == "langchain" else LlamaIndexDoor
    return cls(demo_dir, chat_template=THINKS, **kw)


@pytest.mark.parametrize("kind", DOORS)
def test_thinking_comes_apart_from_the_answer_streamed_or_not(kind, demo_dir, server):
    door = _door(kind, demo_dir, server, max_tokens=60)
    content, thought, tokens = door.ask()
    assert "Paris" in thought and "<think>" not in thought + (content or "") and "</think>" not in (content or "")
    assert tokens > 0
    streamed_content, streamed_thought = door.stream()
    assert streamed_thought == thought and (streamed_content or "") == (content or "")


@pytest.mark.parametrize("kind", DOORS)
def test_the_budget_closes_the_block_and_the_answer_follows(kind, demo_dir, server):
    door = _door(kind, demo_dir, server, max_tokens=60, max_reasoning_tokens=4)
    content, thought, tokens = door.ask()
    assert 4 <= tokens <= 4 + END_TOKENS  # the budget, then the end delimiter the runtime wrote
    assert thought and len(thought) < 40 and "</think>" not in (content or "")
    assert content  # after the block the model answers, within max_tokens


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_structured_output_is_constrained_only_after_the_thinking(method, demo_dir):
    from exllama_integrations.langchain import ChatExLlama

    chat = ChatExLlama(
        model_dir=str(demo_dir),
        backend="transformers",
        temperature=0,
        max_tokens=80,
        chat_template=THINKS,
        max_reasoning_tokens=6,
    )
    schema = City if method != "json_mode" else None
    runnable = chat.with_structured_output(schema, method=method, include_raw=True)
    out = runnable.invoke(Q + " Answer in JSON with name and country.")
    raw = out["raw"]
    assert out["parsing_error"] is None and out["parsed"]
    thought = raw.additional_kwargs["reasoning_content"]
    assert thought and thought not in str(raw.content)  # it thought first (free text, up to the budget) ...
    assert raw.usage_metadata["output_token_details"]["reasoning"] >= 6  # ... then answered under the grammar
    if method == "function_calling":
        assert raw.tool_calls and raw.tool_calls[0]["name"] == "City"  # a call written after thinking is a call
    elif method == "json_schema":
        assert isinstance(out["parsed"], City) and out["parsed"].name


def test_llama_index_structured_predict_after_thinking(demo_dir):
    from llama_index.core.prompts import PromptTemplate

    from exllama_integrations.llama_index import ExLlamaLLM

    llm = ExLlamaLLM(
        model_dir=str(demo_dir),
        backend="transformers",
        temperature=0,
        max_new_tokens=80,
        chat_template=THINKS,
        max_reasoning_tokens=6,
    )
    city = llm.structured_predict(City, PromptTemplate("{q} Answer in JSON."), q=Q)
    assert isinstance(city, City) and city.name


def test_a_constrained_answer_the_budget_cannot_reach_raises(demo_dir):
    from exllama_integrations.langchain import ChatExLlama

    chat = ChatExLlama(
        model_dir=str(demo_dir), backend="transformers", temperature=0, max_tokens=20, chat_template=THINKS
    )
    with pytest.raises(ConstraintViolationError, match="still thinking.*max_reasoning_tokens"):
        chat.with_structured_output(City).invoke(Q)  # no budget: it thinks until max_tokens


@pytest.mark.parametrize("kind", ["langchain", "llama_index", "server"])
def test_enable_thinking_false_per_call(kind, demo_dir, demo_runtime):
    """With Qwen3's template shape: the default lets the model open a block; enable_thinking=False closes it."""
    prepared = []
    if kind == "server":
        s = ThreadServer(demo_runtime, chat_template=QWEN3)
        try:
            import openai

            client = openai.OpenAI(base_url=s.url + "/v1", api_key="none")
            r = client.chat.completions.create(
                model="SmolLM2-135M-Instruct",
                messages=[{"role": "user", "content": Q}],
                max_tokens=20,
                temperature=0,
                extra_body={"chat_template_kwargs": {"enable_thinking": False}},
            )
            assert r.usage.completion_tokens_details.reasoning_tokens == 0 and r.choices[0].message.content
        finally:
            s.stop()
        return
    if kind == "langchain":
        from exllama_integrations.langchain import ChatExLlama

        chat = ChatExLlama(
            model_dir=str(demo_dir), backend="transformers", temperature=0, max_tokens=20, chat_template=QWEN3
        )
        for kw in ({}, {"chat_template_kwargs": {"enable_thinking": False}}):
            from langchain_core.messages import HumanMessage

            prepared.append(chat._prepare([HumanMessage(Q)], None, kw).request)
        msg = chat.invoke(Q, chat_template_kwargs={"enable_thinking": False})
        assert msg.content and msg.usage_metadata["output_token_details"]["reasoning"] == 0
    else:
        from llama_index.core.base.llms.types import ChatMessage

        from exllama_integrations.llama_index import ExLlamaLLM

        llm = ExLlamaLLM(
            model_dir=str(demo_dir), backend="transformers", temperature=0, max_new_tokens=20, chat_template=QWEN3
        )
        for kw in ({}, {"chat_template_kwargs": {"enable_thinking": False}}):
            prepared.append(llm._prepare([ChatMessage(role="user", content=Q)], kw).request)
    default, off = prepared
    assert default.reasoning is not None and not default.reasoning.started  # the model may open a block
    assert off.reasoning is None and str(off.prompt).endswith("<think>\n\n</think>\n\n")


@pytest.mark.parametrize("template", ["drops", "keeps"])
def test_an_earlier_turns_thinking_goes_to_the_template_which_keeps_or_drops_it(template, demo_dir):
    from langchain_core.messages import AIMessage, HumanMessage

    from exllama_integrations.langchain import ChatExLlama

    chat = ChatExLlama(
        model_dir=str(demo_dir),
        backend="transformers",
        temperature=0,
        max_tokens=20,
        chat_template=QWEN3 if template == "drops" else KEEPS,
    )
    earlier = AIMessage("Paris.", additional_kwargs={"reasoning_content": "France's capital is Paris"})
    history = [HumanMessage(Q), earlier, HumanMessage("And of Spain?")]
    prompt = str(chat._prepare(history, None, {}).prompt)
    assert ("France's capital is Paris" in prompt) == (template == "keeps")
    assert "Paris." in prompt


def test_reasoning_is_found_in_the_template_and_a_model_without_it_does_not_reason(demo_runtime):
    assert demo_runtime.model_info().reasoning is None  # SmolLM2's own template shows no thinking block
    rt = ExLlamaRuntime.shared(demo_runtime.model.path, "transformers")
    assert rt is demo_runtime
    from exllama_integrations.chat.prepare import ChatRequest, prepare_chat

    plain = prepare_chat(rt, ChatRequest([{"role": "user", "content": Q}]))
    tagged = prepare_chat(rt, ChatRequest([{"role": "user", "content": Q}], chat_template=THINKS))
    assert plain.request.reasoning is None
    assert tagged.request.reasoning is not None and tagged.request.reasoning.started


def test_the_server_counts_reasoning_in_the_usage_of_a_streamed_reply(server):
    import httpx

    body = {
        "messages": [{"role": "user", "content": Q}],
        "max_tokens": 40,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    lines = [
        line
        for line in httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).text.splitlines()
        if line.startswith("data: {")
    ]
    usage = json.loads(lines[-1][6:])["usage"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] > 0
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}  # the CPU backend reuses nothing
