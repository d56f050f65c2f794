"""LlamaIndex ExLlamaLLM on the CPU backend.

What needs a trained model's answers (Paris, a query engine, structured output and tool calls under a grammar) runs
on the real demo model (``llm``); the plumbing (metadata, stop strings, seeds, the event loop, token counting) on
SmolLM2's tokenizer over a tiny random model (``tiny``), ~20x faster.
"""

from __future__ import annotations

import asyncio

import pytest
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from pydantic import BaseModel

from exllama_integrations import InvalidSettingsError
from exllama_integrations.llama_index import ExLlamaLLM

from fixture_models import TINY_SMOLLM2
from helpers import loop_ticks

Q = "What is the capital of France?"


@pytest.fixture(scope="module")
def llm(where) -> ExLlamaLLM:
    return ExLlamaLLM(**where, temperature=0, max_new_tokens=40)


@pytest.fixture(scope="module")
def tiny(tiny_where) -> ExLlamaLLM:
    return ExLlamaLLM(**tiny_where, temperature=0, max_new_tokens=40)


def user(text: str) -> list[ChatMessage]:
    return [ChatMessage(role=MessageRole.USER, content=text)]


def test_metadata_is_read_from_the_model(tiny: ExLlamaLLM):
    llm = tiny
    md = llm.metadata
    assert md.context_window == llm.exllama_runtime.model_info().context_length == 8192
    assert md.num_output == 40 and md.is_chat_model and md.is_function_calling_model
    assert md.model_name == TINY_SMOLLM2  # the model directory's name


def test_complete_and_stream_complete(where):
    llm = ExLlamaLLM(**where, temperature=0, max_new_tokens=8)  # Paris comes first; the model would write 29 tokens
    r = llm.complete("The capital of France is")
    assert "Paris" in r.text and r.raw["usage"]["prompt_tokens"] == len(
        llm.exllama_runtime.encode("The capital of France is", add_special_tokens=True)
    )
    parts = list(llm.stream_complete("The capital of France is"))
    assert parts[-1].text == r.text
    assert "".join(p.delta for p in parts) == r.text
    assert all(parts[i].text == parts[i - 1].text + parts[i].delta for i in range(1, len(parts)))
    assert "usage" in parts[-1].raw and all("usage" not in p.raw for p in parts[:-1])


def test_chat_uses_the_template_natively(llm: ExLlamaLLM):
    r = llm.chat(user(Q))
    assert "Paris" in r.message.content and r.message.role == MessageRole.ASSISTANT
    prompt = llm.exllama_runtime.chat_prompt([{"role": "user", "content": Q}])
    assert r.raw["usage"]["prompt_tokens"] == len(llm.exllama_runtime.encode(prompt))
    streamed = list(llm.stream_chat(user(Q)))
    assert streamed[-1].message.content == r.message.content
    assert "".join(s.delta for s in streamed) == r.message.content


def test_stop_and_sampling_fields(tiny_where, tiny: ExLlamaLLM):
    full = tiny.chat(user(Q)).message.content
    word = full.split()[3]  # a word inside the reply (40 tokens of words)
    cut = tiny.chat(user(Q), stop=[word]).message.content
    assert word not in cut and cut and full.startswith(cut)
    with pytest.raises(InvalidSettingsError, match="temperature"):
        ExLlamaLLM(**tiny_where, temperature=-3)
    seeded = ExLlamaLLM(**tiny_where, temperature=1.0, seed=3, max_new_tokens=12)
    assert seeded.complete("Once upon a time").text == seeded.complete("Once upon a time").text


def test_system_prompt_and_prompt_overrides(tiny_where):
    sys_llm = ExLlamaLLM(
        **tiny_where,
        temperature=0,
        max_new_tokens=20,
        system_prompt="You only answer in French.",
    )
    prepared = sys_llm._prepare(user(Q), {})
    assert "You only answer in French." in prepared.prompt
    custom = ExLlamaLLM(
        **tiny_where,
        temperature=0,
        max_new_tokens=8,
        messages_to_prompt=lambda msgs: "Q: " + msgs[-1].content + "\nA:",
        completion_to_prompt=lambda p: "Complete: " + p,
    )
    prepared = custom._prepare(user(Q), {})
    assert prepared.prompt == "Q: " + Q + "\nA:"
    assert custom._completion_prompt("x", formatted=False) == "Complete: x"
    assert custom._completion_prompt("x", formatted=True) == "x"


async def test_async_forms_keep_the_loop_free(tiny: ExLlamaLLM):
    llm = tiny
    async with loop_ticks() as ticks:
        r = await llm.acomplete("The capital of France is")
        c = await llm.achat(user(Q))
        deltas = [x.delta async for x in await llm.astream_chat(user(Q))]
        comp = [x.delta async for x in await llm.astream_complete("The capital of France is")]
    ticks.assert_free()
    assert r.text == llm.complete("The capital of France is").text
    assert "".join(deltas) == c.message.content == llm.chat(user(Q)).message.content
    assert "".join(comp) == r.text


def test_token_counting_handler_counts_exactly_once(tiny: ExLlamaLLM):
    llm = tiny
    from llama_index.core.callbacks import CallbackManager, TokenCountingHandler

    counter = TokenCountingHandler(tokenizer=llm.tokenizer_fn)
    llm.callback_manager = CallbackManager([counter])
    try:
        r = llm.chat(user(Q))
        assert counter.prompt_llm_token_count == r.raw["usage"]["prompt_tokens"]
        assert counter.completion_llm_token_count == r.raw["usage"]["completion_tokens"]
        assert len(counter.llm_token_counts) == 1  # chat is not also counted as a completion
        counter.reset_counts()
        list(llm.stream_chat(user(Q)))
        assert counter.completion_llm_token_count == r.raw["usage"]["completion_tokens"]
        counter.reset_counts()
        c = llm.complete("The capital of France is")
        assert counter.total_llm_token_count == c.raw["usage"]["total_tokens"]
    finally:
        llm.callback_manager = CallbackManager([])
    assert llm.tokenizer_fn("Hello world") == llm.exllama_runtime.tokenizer.encode(
        "Hello world", add_special_tokens=False
    )


def test_query_engine_over_a_summary_index(llm: ExLlamaLLM):
    from llama_index.core import Document, Settings, SummaryIndex

    Settings.llm = llm
    Settings.tokenizer = llm.tokenizer_fn
    docs = [
        Document(text="Paris is the capital of France."),
        Document(text="Berlin is the capital of Germany."),
        Document(text="The Eiffel Tower is in Paris."),
    ]
    index = SummaryIndex.from_documents(docs)
    answer = index.as_query_engine(llm=llm).query(Q)
    assert "Paris" in str(answer)


def test_structured_predict(llm: ExLlamaLLM):
    from llama_index.core.prompts import PromptTemplate

    class Country(BaseModel):
        name: str
        capital: str

    out = llm.structured_predict(Country, PromptTemplate("Give the country whose capital is {city}."), city="Paris")
    assert isinstance(out, Country) and out.capital
    sllm = llm.as_structured_llm(Country)
    resp = sllm.chat(user("Give the country whose capital is Paris."))
    assert isinstance(resp.raw, Country)


def test_predict_and_call_with_a_required_tool(llm: ExLlamaLLM):
    from llama_index.core.tools import FunctionTool

    calls = []

    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    resp = llm.predict_and_call([FunctionTool.from_defaults(add)], "What is 2 + 3?", tool_required=True)
    assert calls and calls[0] == (2, 3) and "5" in str(resp)
    r = llm.chat_with_tools([FunctionTool.from_defaults(add)], "What is 2 + 3?", tool_required=True)
    sel = llm.get_tool_calls_from_response(r)
    assert sel[0].tool_name == "add" and sel[0].tool_kwargs == {"a": 2, "b": 3} and sel[0].tool_id.startswith("call_")


async def test_function_agent_calls_a_tool(llm: ExLlamaLLM):
    from llama_index.core.agent.workflow import FunctionAgent

    calls = []

    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        calls.append((a, b))
        return a * b

    agent = FunctionAgent(tools=[multiply], llm=llm, initial_tool_choice="multiply")
    result = await asyncio.wait_for(agent.run("What is 6 times 7?"), timeout=120)
    assert calls == [(6, 7)]
    answer = str(result.response.content or "")
    assert answer.strip() and "tool_response>" not in answer  # after the call, an answer in words


def test_shares_the_runtime_with_langchain(where, llm: ExLlamaLLM):
    from exllama_integrations.langchain import ChatExLlama
    from exllama_integrations.langchain import ExLlamaLLM as LCLLM

    assert LCLLM(**where).exllama_runtime is llm.exllama_runtime
    assert ChatExLlama(**where).exllama_runtime is llm.exllama_runtime
