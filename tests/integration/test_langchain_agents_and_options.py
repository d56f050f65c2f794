"""LangChain classes in use: structured output in the schema's order and streamed whole, agents with a forced
first step or a response format, other tools' argument names, the CPU backend's thread count. (From the review at
b073b3e, round 3.)
"""

from __future__ import annotations

import pytest

from exllama_integrations import ExLlamaRuntime, InvalidSettingsError


def test_structured_output_keeps_the_schemas_order(demo_dir):
    from pydantic import BaseModel

    from exllama_integrations.langchain import ChatExLlama

    class Verdict(BaseModel):
        reasoning: str
        answer: bool

    chat = ChatExLlama(model_dir=str(demo_dir), backend="transformers", temperature=0, max_tokens=80)
    out = chat.with_structured_output(Verdict, include_raw=True).invoke("Is Paris in France? Reason, then answer.")
    assert str(out["raw"].content).lstrip().startswith('{"reasoning"')  # reason first, then answer


def test_structured_output_streams_only_complete_objects(demo_dir):
    from pydantic import BaseModel

    from exllama_integrations.langchain import ChatExLlama

    class City(BaseModel):
        name: str
        country: str

    chat = ChatExLlama(model_dir=str(demo_dir), backend="transformers", temperature=0, max_tokens=60)
    streamed = list(chat.with_structured_output(City).stream("Tell me about Paris."))
    assert len(streamed) == 1 and streamed[0].name and streamed[0].country  # never City(name='', ...)


def test_a_langchain_agent_whose_first_step_is_forced_answers_after_its_tool(demo_dir):
    """docs/tool-calls.md's ``create_agent`` example: a 135M model does not pick a tool by itself, so a middleware sets
    ``tool_choice`` for the first model call; the tool runs and the agent's last message is an answer in words."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import wrap_model_call
    from langchain_core.messages import AIMessage, ToolMessage
    from langchain_core.tools import tool

    from exllama_integrations.langchain import ChatExLlama

    calls = []

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    @wrap_model_call
    def call_a_tool_first(request, handler):
        if not any(isinstance(m, ToolMessage) for m in request.messages):
            request = request.override(tool_choice="add")
        return handler(request)

    chat = ChatExLlama(model_dir=str(demo_dir), backend="transformers", temperature=0, max_tokens=40)
    agent = create_agent(chat, tools=[add], middleware=[call_a_tool_first])
    out = agent.invoke({"messages": [("user", "What is 2 + 3? Use the add tool.")]})
    last = out["messages"][-1]
    assert calls == [(2, 3)] and isinstance(last, AIMessage) and not last.tool_calls
    assert last.text.strip() and "tool_response>" not in last.text


def test_create_agent_with_a_response_format_uses_the_grammar_not_a_tool(demo_dir):
    """``create_agent(model=ChatExLlama(...), response_format=Schema)``: the profile says structured output is
    native, so LangChain's ProviderStrategy sends ``response_format`` and the grammar writes the answer."""
    from langchain.agents import create_agent
    from pydantic import BaseModel

    from exllama_integrations.langchain import ChatExLlama

    class City(BaseModel):
        name: str
        country: str

    chat = ChatExLlama(model_dir=str(demo_dir), backend="transformers", temperature=0, max_tokens=60)
    out = create_agent(chat, tools=[], response_format=City).invoke({"messages": [("user", "Tell me about Paris.")]})
    last = out["messages"][-1]
    assert isinstance(out["structured_response"], City) and out["structured_response"].name
    assert not last.tool_calls and last.response_metadata["constraint_complete"] is True  # not ToolStrategy


def test_names_from_other_tools(demo_dir):
    from exllama_integrations.langchain import ChatExLlama, ExLlamaLLM

    assert ChatExLlama(model=str(demo_dir), backend="transformers").model_dir == str(demo_dir)  # ChatOllama's name
    llm = ExLlamaLLM(model_dir=str(demo_dir), backend="transformers", num_predict=3, temperature=0)
    assert llm.max_new_tokens == 3
    with pytest.raises(InvalidSettingsError, match="num_ctx.*max_seq_len"):
        ExLlamaLLM(model_dir=str(demo_dir), backend="transformers", num_ctx=4096)


def test_the_cpu_backend_takes_a_thread_count(demo_dir):
    import torch

    before = torch.get_num_threads()
    rt = ExLlamaRuntime(demo_dir, "transformers", num_threads=1)
    try:
        assert rt.model_info().details["threads"] == 1 and torch.get_num_threads() == 1
    finally:
        rt.close()
        torch.set_num_threads(before)
    with pytest.raises(InvalidSettingsError, match="num_threads"):
        ExLlamaRuntime(demo_dir, "transformers", num_threads=0)
