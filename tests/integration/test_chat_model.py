"""ChatExLlama: templates, usage, stop, tools, structured output, async, sharing.

What needs a trained model's answers (it names Paris, stops by itself, closes a JSON string under a grammar, answers in
words after a tool result) runs on the real demo model (``chat``); the plumbing (callbacks, streaming, usage, stop
strings, batching, logprobs, the event loop) on SmolLM2's tokenizer over a tiny random model (``tiny``), ~20x faster.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from pydantic import BaseModel, Field

from exllama_integrations import ConstraintError, ConstraintViolationError, InvalidSettingsError
from exllama_integrations.chat.history import ANSWER_NOTE
from exllama_integrations.chat.prepare import prepare_chat
from exllama_integrations.langchain import ChatExLlama, ExLlamaLLM
from exllama_integrations.langchain.messages import to_template_messages

from helpers import loop_ticks


@pytest.fixture(scope="module")
def chat(where) -> ChatExLlama:
    return ChatExLlama(**where, temperature=0, max_tokens=60)


@pytest.fixture(scope="module")
def tiny(tiny_where) -> ChatExLlama:
    return ChatExLlama(**tiny_where, temperature=0, max_tokens=60)


def hf_render(model_dir, messages, **kw) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)


CONVERSATION = [
    SystemMessage("You are terse."),
    HumanMessage("Hi, I'm Ana."),
    AIMessage("Hello Ana."),
    HumanMessage("What's my name?", name="ana"),
    HumanMessage("Answer in one word."),  # repeated role
]


def test_template_matches_reference_rendering(chat: ChatExLlama, demo_dir):
    dicts = to_template_messages(CONVERSATION)
    ours = chat.exllama_runtime.chat_prompt(dicts)
    assert ours == hf_render(demo_dir, dicts)
    assert ours.endswith("<|im_start|>assistant\n")
    # without a system message, SmolLM2's template adds its default one, as the reference does
    assert chat.exllama_runtime.chat_prompt([{"role": "user", "content": "hi"}]) == hf_render(
        demo_dir, [{"role": "user", "content": "hi"}]
    )


def test_template_with_native_tools_matches_reference(tmp_path):
    """A template that renders `tools` and `tool_calls` itself (Llama-3/Qwen style) gets HF's data shapes."""
    from fixture_models import Shape, make_llama

    d = make_llama(tmp_path / "m", Shape(hidden=64, layers=1, heads=2, kv_heads=2, inter=128, vocab=300), device="cpu")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{% if tools %}TOOLS:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}\n{% endif %}"
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}"
        "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c['function']['name'] }} "
        "{{ c['function']['arguments'] | tojson }}{% endfor %}{% endif %}"
        "{% if m['role'] == 'tool' %}({{ m['tool_call_id'] }}){% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    c = ChatExLlama(model_dir=str(d), backend="transformers", shared_runtime=False)
    assert c.exllama_runtime.model_info().renders_tools
    msgs = [
        HumanMessage("add 1 and 2"),
        AIMessage("", tool_calls=[{"name": "add", "args": {"a": 1, "b": 2}, "id": "c1"}]),
        ToolMessage("3", tool_call_id="c1", name="add"),
    ]
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add.",
                "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
            },
        }
    ]
    dicts = to_template_messages(msgs)
    ours = c.exllama_runtime.chat_prompt(dicts, tools=tools)
    assert ours == hf_render(d, dicts, tools=tools)
    assert 'CALL add {"a": 1, "b": 2}' in ours and "(c1)" in ours and "TOOLS:add;" in ours
    c.exllama_runtime.close()


def test_invoke_answers_with_usage_and_metadata(chat: ChatExLlama):
    msg = chat.invoke("What is the capital of France?")
    assert "Paris" in msg.content
    prompt_tokens = chat.get_num_tokens_from_messages([HumanMessage("What is the capital of France?")])
    assert msg.usage_metadata["input_tokens"] == prompt_tokens
    assert msg.usage_metadata["total_tokens"] == prompt_tokens + msg.usage_metadata["output_tokens"]
    md = msg.response_metadata
    assert md["model_name"] == "SmolLM2-135M-Instruct" and md["finish_reason"] == "stop"
    assert md["time_to_first_token"] > 0


def test_invoke_streams_to_a_listening_handler_only(tiny: ChatExLlama):
    chat = tiny
    from langchain_core.callbacks import BaseCallbackHandler

    class Tokens(BaseCallbackHandler):
        def __init__(self) -> None:
            self.tokens: list[str] = []

        def on_llm_new_token(self, token: str, **kwargs) -> None:
            self.tokens.append(token)

    listening = Tokens()
    heard = chat.invoke("Name a color.", config={"callbacks": [listening]})
    assert len(listening.tokens) > 1 and "".join(listening.tokens) == heard.content
    quiet = chat.invoke("Name a color.")  # nobody listens: the reply is read whole, the same reply
    assert quiet.content == heard.content and quiet.usage_metadata == heard.usage_metadata
    assert quiet.response_metadata["time_to_first_token"] > 0


def test_stream_usage_set_once_and_matches_invoke(tiny: ChatExLlama):
    chat = tiny
    chunks = list(chat.stream("Name a color."))
    with_usage = [c for c in chunks if c.usage_metadata]
    assert len(with_usage) == 1 and chunks[-1].chunk_position == "last"
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    assert full.content == chat.invoke("Name a color.").content


def test_stop_from_call_and_constructor(tiny_where, tiny: ChatExLlama):
    full = tiny.invoke("What is the capital of France?").content
    word = full.split()[3]  # a word well inside the reply (the tiny model writes 60 tokens of words)
    cut = tiny.invoke("What is the capital of France?", stop=[word]).content
    assert word not in cut and full.startswith(cut)
    c2 = ChatExLlama(**tiny_where, temperature=0, max_tokens=60, stop=[word])
    assert c2.invoke("What is the capital of France?").content == cut


def test_shares_the_runtime_with_the_llm(where, chat: ChatExLlama):
    llm = ExLlamaLLM(**where)
    assert llm.exllama_runtime is chat.exllama_runtime
    many = [ChatExLlama(**where, temperature=t / 10) for t in range(5)]
    assert {id(m.exllama_runtime) for m in many} == {id(chat.exllama_runtime)}


class City(BaseModel):
    """A city."""

    name: str = Field(description="the city's name")
    country: str
    is_capital: bool


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output_parses(chat: ChatExLlama, method: str):
    for q in ["Tell me about Paris.", "Tell me about Tokyo.", "Describe Rome."]:
        city = chat.with_structured_output(City, method=method).invoke(q, max_tokens=80)
        assert isinstance(city, City) and city.name


def test_structured_output_typeddict_jsonschema_and_include_raw(chat: ChatExLlama):
    schema = {
        "title": "answer",
        "description": "An answer.",
        "type": "object",
        "properties": {"capital": {"type": "string"}, "sure": {"type": "boolean"}},
        "required": ["capital", "sure"],
    }
    out = chat.with_structured_output(schema).invoke("What is the capital of France?")
    assert set(out) == {"capital", "sure"} and isinstance(out["sure"], bool)
    raw = chat.with_structured_output(City, include_raw=True).invoke("Tell me about Paris.")
    assert isinstance(raw["raw"], AIMessage) and isinstance(raw["parsed"], City) and raw["parsing_error"] is None


def test_structured_output_cut_short_is_reported(tiny: ChatExLlama):
    with pytest.raises(ConstraintViolationError, match="max_tokens=5"):
        tiny.with_structured_output(City).invoke("Tell me about Paris.", max_tokens=5)


def test_invalid_schema_is_a_typed_error(chat: ChatExLlama):
    with pytest.raises(ConstraintError, match="objectx"):
        chat.with_structured_output({"type": "objectx", "properties": {}}).invoke("hi")


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def get_weather(city: str, unit: str = "celsius") -> str:
    """Get the weather in a city."""
    return "sunny"


def _valid_call(msg: AIMessage) -> dict:
    """The one tool call of a forced reply, checked: an id, arguments valid for its tool, finish_reason."""
    assert len(msg.tool_calls) == 1 and not msg.invalid_tool_calls
    call = msg.tool_calls[0]
    assert call["id"].startswith("call_")
    if call["name"] == "add":
        assert set(call["args"]) == {"a", "b"} and all(isinstance(v, int) for v in call["args"].values())
    else:
        assert "city" in call["args"] and isinstance(call["args"]["city"], str)
    assert msg.response_metadata["finish_reason"] == "tool_calls"
    return call


@pytest.mark.parametrize("choice", ["any", "add", "get_weather"])
def test_forced_tool_calls_are_always_valid(chat: ChatExLlama, choice):
    bound = chat.bind_tools([add, get_weather], tool_choice=choice)
    for q in ["What is 2 + 3?", "Weather in Paris?", "Tell me a story about ümlauts and 日本."]:
        call = _valid_call(bound.invoke(q))
        if choice != "any":
            assert call["name"] == choice


def test_a_tool_choice_given_as_a_dict_forces_that_tool(chat: ChatExLlama):
    """OpenAI's spelling of a named choice forces the tool it names, as the name does: asked for the weather, the
    model still calls ``add``. The forced grammar it resolves to is the name's, checked on every prompt by
    test_forced_tool_calls_are_always_valid[add]."""
    bound = chat.bind_tools([add, get_weather], tool_choice={"type": "function", "function": {"name": "add"}})
    assert _valid_call(bound.invoke("Weather in Paris?"))["name"] == "add"


def test_streamed_tool_call_aggregates_and_keeps_unicode(chat: ChatExLlama):
    def echo(text: str) -> str:
        """Repeat the text."""
        return text

    chunks = list(chat.bind_tools([echo], tool_choice="echo").stream("Repeat exactly: Crème brûlée", max_tokens=100))
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    assert len(full.tool_calls) == 1 and full.tool_calls[0]["name"] == "echo"
    assert "<tool_call>" not in full.content
    text = full.tool_calls[0]["args"]["text"]
    assert "è" in text or "û" in text or "é" in text  # non-ASCII survives grammar, detokenizer and parsing
    assert "\\u" not in text


def test_tool_choice_none_and_unknown(tiny: ChatExLlama):
    chat = tiny
    msg = chat.bind_tools([add], tool_choice="none").invoke("What is 2 + 3?")
    assert msg.tool_calls == [] and msg.content
    with pytest.raises(InvalidSettingsError, match="names no bound tool"):
        chat.bind_tools([add], tool_choice="multiply")


def test_tool_message_history_is_rendered_back(chat: ChatExLlama):
    history = [
        HumanMessage("What is 2 + 3?"),
        AIMessage("", tool_calls=[{"name": "add", "args": {"a": 2, "b": 3}, "id": "call_1"}]),
        ToolMessage("5", tool_call_id="call_1", name="add"),
    ]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    prompt = prepare_chat(chat.exllama_runtime, chat._chat_request(history, None, {"tools": tools})).prompt
    assert '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>' in prompt
    assert "<tool_response>\n5\n</tool_response>\n" + ANSWER_NOTE in prompt
    answer = chat.bind_tools([add]).invoke(history)
    # the fallback's markup is ours: the model answers in words and never writes a tool result itself
    assert answer.content.strip() and "tool_response>" not in answer.content
    assert answer.response_metadata["finish_reason"] in ("stop", "tool_calls")


def test_logprobs_on_request(tiny: ChatExLlama):
    chat = tiny
    msg = chat.invoke("Say yes.", logprobs=True, top_logprobs=2, max_tokens=3)
    content = msg.response_metadata["logprobs"]["content"]
    assert 1 <= len(content) <= 3
    assert all(e["logprob"] <= 0 and len(e["top_logprobs"]) == 2 for e in content)


def test_images_are_refused_clearly(chat: ChatExLlama):
    """A text-only model says so (images in: tests/integration/test_images.py)."""
    png = (
        "data:image/png;base64,"
        "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAAAAAA6fptVAAAACklEQVR4nGNgAAAAAgABSK+kcQAAAABJRU5ErkJggg=="
    )
    with pytest.raises(InvalidSettingsError, match="takes no images.*send text only"):
        chat.invoke([HumanMessage(content=[{"type": "image_url", "image_url": {"url": png}}])])
    with pytest.raises(InvalidSettingsError, match="not taken here"):  # an image in a system turn: never
        chat.invoke([SystemMessage(content=[{"type": "image_url", "image_url": {"url": png}}]), HumanMessage("hi")])


async def test_async_stream_keeps_loop_free(tiny: ChatExLlama):
    chat = tiny
    async with loop_ticks() as ticks:
        text = "".join([c.content async for c in chat.astream("Write a sentence about llamas.")])
    assert text
    ticks.assert_free()
    assert (await chat.ainvoke("Write a sentence about llamas.")).content == text
    assert len(await chat.abatch(["Hi", "Hello"])) == 2


def test_small_model_structured_output_with_no_repeat_ngram(chat: ChatExLlama):
    """The lever for loops in tiny models: the standard Joke prompt completes with a 3-gram ban."""

    class Joke(BaseModel):
        """Joke to tell user."""

        setup: str = Field(description="question to set up a joke")
        punchline: str = Field(description="answer to resolve the joke")

    with pytest.raises(ConstraintViolationError):
        chat.with_structured_output(Joke).invoke("Tell me a joke about cats.", max_tokens=100)
    joke = chat.with_structured_output(Joke).invoke(
        "Tell me a joke about cats.", max_tokens=100, no_repeat_ngram_size=3
    )
    assert joke.setup and joke.punchline


def test_batch_runs_every_input_at_once(tiny: ChatExLlama):
    chat = tiny
    """LangChain's default pool (min(32, CPUs + 4) threads) would run a batch of 8 in waves on a small machine."""
    import threading

    from langchain_core.callbacks import BaseCallbackHandler

    lock, running, peak = threading.Lock(), [0], [0]

    class Overlap(BaseCallbackHandler):
        def on_chat_model_start(self, *args, **kwargs):
            with lock:
                running[0] += 1
                peak[0] = max(peak[0], running[0])

        def on_llm_end(self, *args, **kwargs):
            with lock:
                running[0] -= 1

    msgs = chat.batch([f"Say the number {i}." for i in range(8)], config={"callbacks": [Overlap()]}, max_tokens=6)
    assert peak[0] == 8
    assert [m.content for m in msgs[:2]] == [
        chat.invoke(f"Say the number {i}.", max_tokens=6).content for i in range(2)
    ]

    async def inside_a_running_loop():  # a notebook cell: chat.batch() while a loop runs in this thread
        return chat.batch(["Say the number 0."], max_tokens=6)

    assert asyncio.run(inside_a_running_loop())[0].content == msgs[0].content
    limited = [0]

    class Limited(Overlap):
        def on_chat_model_start(self, *args, **kwargs):
            super().on_chat_model_start()
            limited[0] = max(limited[0], running[0])

    running[0] = 0
    chat.batch(["Hi."] * 4, config={"callbacks": [Limited()], "max_concurrency": 1}, max_tokens=2)
    assert limited[0] == 1  # a max_concurrency you set is kept
