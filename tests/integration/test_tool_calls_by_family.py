"""Agents on every model family, through every door: LangChain, LlamaIndex and the OpenAI server.

Each family is a tiny random-weight model built by transformers' own classes with that family's chat template,
control tokens and end-of-turn tokens (tests/tool_families.py). A reply in the family's own format is produced by
the real CPU backend through the real tokenizer, held to exactly that text by a grammar (a runtime wrapper adds it
to each request, as a scripted model would), and must come back as the same tool calls at every door, streamed and
not, with no markup in the streamed text. Then, without any script: ``tool_choice="required"`` and a named tool
make the model write calls in its family's own syntax, read back with arguments valid under the tool's schema; an
agent's second turn (its call and the tool's result) renders through the family's template.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from doors import chat_stream_parts
from scripted import Scripted
from tool_families import (
    EXPECTED,
    EXPECTED_TEXT,
    FAMILIES_2026,
    FAMILIES_TOKENIZER_ONLY,
    TOOLS,
    history,
    make_family,
)
from tool_families import FAMILIES as ALL_FAMILIES

from exllama_integrations import ExLlamaRuntime
from exllama_integrations.chat.formats import FORMATS
from exllama_integrations.chat.outcome import stream_chat
from exllama_integrations.chat.prepare import ChatRequest, prepare_chat
from exllama_integrations.contract.api import GenerationSettings

QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
FAMILIES = {n: f for n, f in ALL_FAMILIES.items() if n not in FAMILIES_TOKENIZER_ONLY}  # (run end to end)
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _bounded(schema):
    """The schema with its strings at most 16 characters (a random-weight model writes a string until cut)."""
    if isinstance(schema, dict):
        out = {k: _bounded(v) for k, v in schema.items()}
        if out.get("type") == "string" and "enum" not in out:
            out["maxLength"] = 16
        return out
    return [_bounded(v) for v in schema] if isinstance(schema, list) else schema


FORCED_TOOLS = _bounded(TOOLS)
# the other doors read the same replies: there, the ones that carry most (two calls, text or thinking first)
_RICH = ("two", "content_then_call", "think_then_call")
# harmony ends its turn after one call (<|call|> is an end-of-turn token): one call a reply; the 2026 families'
# other replies are read at every split and token by token in tests/unit/test_tool_format_reader.py
KEYS = [
    (f, k)
    for f, fam in FAMILIES.items()
    for k in fam.replies
    if not (f == "gpt_oss" and k == "two") and (f not in FAMILIES_2026 or k in _RICH)
]
DOOR_KEYS = [(f, k) for f, k in KEYS if k in _RICH or (f, k) == ("gpt_oss", "one")]


def answer_of(family: str, key: str) -> str:
    """The reply less its thinking (the runtime thinks and closes the block itself)."""
    reply, fam = FAMILIES[family].replies[key], FAMILIES[family]
    if fam.thinking and fam.thinking[1] in reply and (reply.lstrip().startswith(fam.thinking[0]) or fam.thinks_first):
        return reply[reply.find(fam.thinking[1]) + len(fam.thinking[1]) :]
    return reply


@pytest.fixture(scope="module")
def family_runtimes(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    runtimes = {
        n: ExLlamaRuntime(str(make_family(n, root / n, seed=i)), "transformers") for i, n in enumerate(FAMILIES)
    }
    yield runtimes
    for rt in runtimes.values():
        rt.close()


@pytest.fixture(scope="module")
def scripted(family_runtimes):
    return {n: Scripted(rt, n) for n, rt in family_runtimes.items()}


@pytest.fixture(scope="module")
def servers(scripted):
    from servers import ThreadServer

    started = {}

    def server(name: str):
        if name not in started:
            started[name] = ThreadServer(scripted[name])
        return started[name].url

    yield server
    for s in started.values():  # all told to stop first, then waited for: they wind down at once
        s.server.should_exit = True
    for s in started.values():
        s.stop()


def _markup(family: str) -> list[str]:
    fmt = FORMATS[FAMILIES[family].tool_format]
    return [m for m in (*fmt.opens, *fmt.closes, *fmt.strip, *fmt.markup) if len(m.strip()) > 1]


def _check_text(family: str, key: str, pieces: list[str], content: str | None) -> None:
    for p in pieces:
        assert not any(m in p for m in _markup(family)), (family, key, p)
    assert (content or "").strip() == (EXPECTED_TEXT[key][1] or "")


@pytest.mark.parametrize(("family", "key"), KEYS)
def test_langchain_reads_the_family_reply(family, key, scripted):
    from exllama_integrations.langchain import ChatExLlama

    rt = scripted[family]
    rt.reply = answer_of(family, key)
    chat = ChatExLlama(runtime=rt, temperature=0, max_tokens=400).bind_tools(TOOLS)
    msg = chat.invoke(QUESTION)
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == EXPECTED[key] and not msg.invalid_tool_calls
    _check_text(family, key, [], msg.content)
    assert msg.response_metadata["finish_reason"] == ("tool_calls" if EXPECTED[key] else "stop")
    chunks = list(chat.stream(QUESTION))
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    assert [(c["name"], c["args"]) for c in full.tool_calls] == EXPECTED[key] and not full.invalid_tool_calls
    assert len({c["id"] for c in full.tool_calls}) == len(EXPECTED[key])  # one id a call, as streamed
    _check_text(family, key, [c.content for c in chunks], full.content)
    if FAMILIES[family].thinking:  # it thought (kept apart from the answer), then wrote the reply
        assert full.usage_metadata["output_token_details"]["reasoning"] > 0


@pytest.mark.parametrize(("family", "key"), DOOR_KEYS)
def test_llama_index_reads_the_family_reply(family, key, scripted):
    from llama_index.core.llms import ChatMessage

    from exllama_integrations.llama_index import ExLlamaLLM

    rt = scripted[family]
    rt.reply = answer_of(family, key)
    llm = ExLlamaLLM(runtime=rt, temperature=0, max_new_tokens=400)
    messages = [ChatMessage(role="user", content=QUESTION[0]["content"])]
    responses = list(llm.stream_chat(messages, tools=TOOLS))
    calls = llm.get_tool_calls_from_response(responses[-1], error_on_no_tool_call=False)
    assert [(c.tool_name, c.tool_kwargs) for c in calls] == EXPECTED[key]
    assert "invalid_tool_calls" not in responses[-1].message.additional_kwargs
    _check_text(family, key, [r.delta or "" for r in responses], responses[-1].message.content)
    if key in ("two", "think_then_call") or family == "gpt_oss":
        whole = llm.chat(messages, tools=TOOLS)
        assert [(c.tool_name, c.tool_kwargs) for c in llm.get_tool_calls_from_response(whole, False)] == EXPECTED[key]


@pytest.mark.parametrize(("family", "key"), DOOR_KEYS)
def test_the_server_reads_the_family_reply(family, key, scripted, servers):
    import openai

    rt = scripted[family]
    rt.reply = answer_of(family, key)
    client = openai.OpenAI(base_url=servers(family) + "/v1", api_key="x", max_retries=0)
    args = {"model": family, "messages": QUESTION, "tools": TOOLS, "temperature": 0, "max_tokens": 400}
    text, calls, _, finish = chat_stream_parts(client.chat.completions.create(**args, stream=True))
    got = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    assert got == EXPECTED[key]
    assert finish == ("tool_calls" if EXPECTED[key] else "stop")
    _check_text(family, key, text, "".join(text))
    if key in ("two", "think_then_call") or family == "gpt_oss":
        msg = client.chat.completions.create(**args).choices[0].message
        assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []] == EXPECTED[key]


NATIVE = [f for f in FAMILIES if FAMILIES[f].tool_format != "fallback"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_forced_calls_are_written_in_the_family_syntax(family, family_runtimes):
    """required and a named tool: the model (random weights) writes calls its family's reader reads back."""
    from exllama_integrations.langchain import ChatExLlama

    rt = family_runtimes[family]
    fmt = FORMATS[FAMILIES[family].tool_format]
    settings = GenerationSettings(temperature=0, max_new_tokens=550, max_reasoning_tokens=4)
    for choice, names in (("required", set(SCHEMAS)), ("get_time", {"get_time"})):
        prepared = prepare_chat(rt, ChatRequest(QUESTION, settings, tools=FORCED_TOOLS, tool_choice=choice))
        outcome = [o for o in stream_chat(rt, prepared)][-1]
        assert any(m in outcome.raw for m in fmt.opens) or fmt.at_start, outcome.raw  # the family's own syntax
        assert outcome.tool_calls and not outcome.invalid_tool_calls, outcome.raw
        for c in outcome.tool_calls:
            assert c.name in names
            jsonschema.validate(c.arguments, SCHEMAS[c.name])
        if choice != "required" or not fmt.parallel:
            assert len(outcome.tool_calls) == 1
    one = ChatExLlama(runtime=rt, max_tokens=550, max_reasoning_tokens=4).bind_tools(
        FORCED_TOOLS, tool_choice="required", parallel_tool_calls=False
    )
    msg = one.invoke(QUESTION)
    assert len(msg.tool_calls) == 1 and not msg.invalid_tool_calls


@pytest.mark.parametrize("family", list(FAMILIES))
def test_an_agent_turn_renders_through_the_family_template(family, family_runtimes):
    """call -> tool result -> answer: the history goes through the family's template, with OpenAI-style ids."""
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    from exllama_integrations.langchain import ChatExLlama

    rt = family_runtimes[family]
    turns = history(family)
    call = next(m for m in turns if m.get("tool_calls"))["tool_calls"][0]
    args = call["function"]["arguments"]
    args = json.loads(args) if isinstance(args, str) else args
    cid = "call_0123456789abcdef01234567"  # an OpenAI client's id: Mistral's templates take 9 characters only
    messages = [
        HumanMessage(QUESTION[0]["content"]),
        AIMessage("", tool_calls=[{"name": call["function"]["name"], "args": args, "id": cid}]),
        ToolMessage("Sunny, 21C", tool_call_id=cid),
    ]
    chat = ChatExLlama(runtime=rt, temperature=0, max_tokens=8, max_reasoning_tokens=2).bind_tools(TOOLS)
    prompt = prepare_chat(rt, chat_request(chat, messages)).prompt
    text = prompt if isinstance(prompt, str) else rt.decode(list(prompt), skip_special_tokens=False)
    assert "Sunny, 21C" in text and call["function"]["name"] in text
    reply = chat.invoke(messages)  # the model answers after the result
    assert reply.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")


def chat_request(chat, messages):
    bound = chat  # a RunnableBinding: its model and the bound kwargs
    return bound.bound._chat_request(messages, None, dict(bound.kwargs))


def get_weather(city: str, unit: str = "celsius") -> str:
    """Get the current weather in a city."""
    return f"Sunny, 21C in {city}"


def test_a_langchain_agent_runs_on_mistral_calls(scripted):
    """create_agent over a Mistral-format model: its [TOOL_CALLS] call runs the tool, then it answers."""
    from langchain.agents import create_agent

    from exllama_integrations.langchain import ChatExLlama

    rt = scripted["mistral"]
    rt.reply = [FAMILIES["mistral"].replies["one"], FAMILIES["mistral"].replies["answer"]]
    agent = create_agent(ChatExLlama(runtime=rt, temperature=0, max_tokens=200), tools=[get_weather])
    steps = agent.invoke({"messages": [("user", QUESTION[0]["content"])]})["messages"]
    calls = [c for m in steps for c in getattr(m, "tool_calls", [])]
    assert [(c["name"], c["args"]) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert any(m.type == "tool" and "Sunny, 21C in Paris" in m.content for m in steps)
    assert steps[-1].text == EXPECTED_TEXT["answer"][1]
    assert len(calls[0]["id"]) == 9 and calls[0]["id"].isalnum()  # Mistral's own id style, which its template checks


async def test_a_llama_index_function_agent_streams_llama3_calls(scripted):
    """FunctionAgent over a Llama 3-format model: the bare-JSON call streams as a tool-call event and runs."""
    from llama_index.core.agent.workflow import FunctionAgent, ToolCallResult

    from exllama_integrations.llama_index import ExLlamaLLM

    rt = scripted["llama3"]
    rt.reply = [FAMILIES["llama3"].replies["one"], FAMILIES["llama3"].replies["answer"]]
    agent = FunctionAgent(tools=[get_weather], llm=ExLlamaLLM(runtime=rt, temperature=0, max_new_tokens=200))
    handler = agent.run(user_msg=QUESTION[0]["content"])
    results = [e async for e in handler.stream_events() if isinstance(e, ToolCallResult)]
    response = await handler
    assert [(r.tool_name, r.tool_kwargs) for r in results] == [("get_weather", {"city": "Paris"})]
    assert "Sunny, 21C in Paris" in str(results[0].tool_output)
    assert str(response).strip() == EXPECTED_TEXT["answer"][1]


def test_the_fallback_markup_never_ends_an_answer(scripted):
    """A fallback-format model that echoes our ``</tool_response>`` after a result stops there (issue 34, item 9)."""
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    from exllama_integrations.langchain import ChatExLlama

    rt = scripted["phi3"]
    rt.reply = "Sunny, 21C\n</tool_response>\nMore text"
    call = {"name": "get_weather", "args": {"city": "Paris"}, "id": "call_1"}
    messages = [HumanMessage(QUESTION[0]["content"]), AIMessage("", tool_calls=[call])]
    messages.append(ToolMessage("Sunny, 21C", tool_call_id="call_1"))
    reply = ChatExLlama(runtime=rt, temperature=0, max_tokens=60).bind_tools(TOOLS).invoke(messages)
    assert reply.content.strip() == "Sunny, 21C" and reply.response_metadata["stop_string"] == "</tool_response>"


async def test_astream_events_carry_the_family_calls(scripted):
    """LangChain's astream_events: the model's stream events add up to the Mistral reply's two calls."""
    from exllama_integrations.langchain import ChatExLlama

    rt = scripted["mistral"]
    rt.reply = FAMILIES["mistral"].replies["two"]
    chat = ChatExLlama(runtime=rt, temperature=0, max_tokens=400).bind_tools(TOOLS)
    events = [e async for e in chat.astream_events(QUESTION, version="v2")]
    end = next(e for e in events if e["event"] == "on_chat_model_end")["data"]["output"]
    assert [(c["name"], c["args"]) for c in end.tool_calls] == EXPECTED["two"]
    chunks = [e["data"]["chunk"] for e in events if e["event"] == "on_chat_model_stream"]
    assert sum(len(c.tool_call_chunks) for c in chunks) == 2
    assert not any("[TOOL_CALLS]" in c.content for c in chunks)


def test_a_remote_runtime_reads_the_family_format_over_the_wire(scripted, servers):
    """ChatExLlama(base_url=): the server's model info names the format, the request asks its markup shown."""
    from exllama_integrations.langchain import ChatExLlama

    rt = scripted["magistral"]
    rt.reply = answer_of("magistral", "two")
    chat = ChatExLlama(base_url=servers("magistral"), temperature=0, max_tokens=400).bind_tools(TOOLS)
    msg = chat.invoke(QUESTION)
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == EXPECTED["two"] and not msg.invalid_tool_calls
