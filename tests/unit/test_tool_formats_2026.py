"""What the 2026 families' formats hold beyond the replies every family is checked with (test_tool_format_reader).

GLM-4.7's layout without newlines, DeepSeek-V3.2's ``function_calls`` block and DSML's explicit value types, Gemma 4's
argument syntax for every JSON type, Kimi's ids in the history its template shows, DeepSeek-V3.1's arguments as text,
Hy3's tokens built with ``str.format``, Muse Glimmer's messages (an answer's ``to=``, its unstripped values, its
history), and each family's thinking as its own generation prompt leaves it (opened, closed, or the model's to open).
"""

from __future__ import annotations

import json

import pytest
from tool_families import FAMILIES, PREFACE, TOOLS, history

from exllama_integrations.chat.formats import FORMATS, ReplyReader, find_format, read_reply, write_calls
from exllama_integrations.chat.history import family_ids, native_history
from exllama_integrations.chat.reasoning import find_reasoning, generation_prompt, turn_reasoning
from exllama_integrations.model.template import ChatTemplate

ONE = [("get_weather", {"city": "Paris"})]


def _every_split(fmt, text: str, tools=TOOLS):
    whole = read_reply(fmt, text, tools)
    for i in range(len(text) + 1):
        reader = ReplyReader(fmt, tools)
        a, x = reader.feed(text[:i])
        b, y = reader.feed(text[i:])
        c, z = reader.finish()
        assert a + b + c == whole[0]
        assert [(k.name, k.arguments) for k in x + y + z] == [(k.name, k.arguments) for k in whole[1]]
    return whole


def test_glm47_writes_its_parts_without_newlines_and_reads_the_same():
    text = "Checking.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"
    content, calls = _every_split(FORMATS["glm45"], text)
    assert content == "Checking." and [(c.name, c.arguments, c.error) for c in calls] == [*[(*ONE[0], None)]]
    _, calls = _every_split(FORMATS["glm45"], "<tool_call>get_time</tool_call>", ())  # a call without arguments
    assert [(c.name, c.arguments, c.error) for c in calls] == [("get_time", {}, None)]


def test_glm_values_are_typed_by_the_tools_schema():
    tools = [
        {"function": {"name": "f", "parameters": {"properties": {"n": {"type": "integer"}, "s": {"type": "string"}}}}}
    ]
    pair = "<arg_key>{}</arg_key>\n<arg_value>7</arg_value>\n"
    text = "<tool_call>f\n" + pair.format("n") + pair.format("s") + "</tool_call>"
    _, calls = _every_split(FORMATS["glm45"], text, tools)
    assert calls[0].arguments == {"n": 7, "s": "7"}


def test_deepseek_v32_function_calls_and_dsml_typed_values_read():
    dsml = "｜DSML｜"
    text = (
        f'<{dsml}function_calls>\n<{dsml}invoke name="f">\n<{dsml}parameter name="n" string="false">[1, 2]'
        f'</{dsml}parameter>\n<{dsml}parameter name="s" string="true">[1, 2]</{dsml}parameter>\n</{dsml}invoke>\n'
        f"</{dsml}function_calls>"
    )
    _, calls = _every_split(FORMATS["deepseek_v4"], text, ())
    assert calls[0].name == "f" and calls[0].arguments == {"n": [1, 2], "s": "[1, 2]"}


def test_minimax_holds_several_invokes_in_one_block_and_an_unreadable_one_stays_visible():
    fmt = FORMATS["minimax_m2"]
    _, calls = read_reply(fmt, write_calls(fmt, [*ONE, ("get_time", {"timezone": "UTC"})]), TOOLS)
    assert [c.name for c in calls] == ["get_weather", "get_time"] and all(c.error is None for c in calls)
    _, bad = read_reply(fmt, '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris', TOOLS)
    assert bad[0].error and bad[0].name == "get_weather" and "Paris" in bad[0].raw


@pytest.mark.parametrize(
    "arguments",
    [{"s": "a, b: {c}"}, {"n": 3, "x": 1.5, "ok": True, "none": None}, {"o": {"k": "v", "l": [1, "two"]}}, {}],
)
def test_gemma4_arguments_of_every_json_type_write_and_read_back(arguments):
    fmt = FORMATS["gemma4"]
    text = write_calls(fmt, [("f", arguments)])
    _, calls = _every_split(fmt, text, ())
    assert calls[0].arguments == arguments and calls[0].error is None
    # a model that writes JSON strings and quoted keys inside the braces reads the same
    _, calls = read_reply(fmt, "<|tool_call>call:f" + json.dumps(arguments) + "<tool_call|>")
    assert calls[0].arguments == arguments


def test_kimi_ids_in_the_history_carry_the_function_name_and_match_their_results():
    messages = history("kimi_k2")
    messages[1]["tool_calls"][0]["id"] = messages[2]["tool_call_id"] = "call_abc"
    shown = family_ids(messages, FORMATS["kimi_k2"].ids)
    assert shown[1]["tool_calls"][0]["id"] == "functions.get_weather:0" == shown[2]["tool_call_id"]
    assert messages[1]["tool_calls"][0]["id"] == "call_abc"  # the caller's history is left as it was


def test_deepseek_v31_gets_its_arguments_as_text():
    out = native_history(history("deepseek_v31"), FORMATS["deepseek_v31"].history_arguments == "json")
    assert json.loads(out[1]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


def test_hy3_is_found_from_tokens_its_template_builds_with_format():
    template = FAMILIES["hy3"].template
    assert "<tool_calls:opensource>" not in template and "'<tool_calls{}>'.format(HYTK)" in template
    assert find_format(template).name == "hy3"
    assert find_reasoning(template).start == "<think:opensource>"
    _, calls = _every_split(
        FORMATS["hy3"],
        "<tool_calls:opensource>\n<tool_call:opensource>get_time\n</tool_call:opensource>\n</tool_calls:opensource>",
        (),
    )
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("get_time", {}, None)
    ]  # without <tool_sep>, as TabbyAPI


GLIMMER_CALL = (
    ' to=get_weather<|message|><atem:function_calls>\n<atem:invoke name="get_weather">\n'
    '<atem:parameter name="city"> Paris </atem:parameter>\n</atem:invoke>\n</atem:function_calls>'
)


def test_glimmer_answer_text_keeps_to_and_a_call_keeps_its_spaces():
    fmt = FORMATS["muse_glimmer"]
    content, calls = _every_split(fmt, " to=user<|message|>See https://x.org/?to=bob and to=me.", ())
    assert content == "See https://x.org/?to=bob and to=me." and calls == []
    content, calls = _every_split(fmt, f" to=user<|message|>{PREFACE}<|eom|><|start|>assistant{GLIMMER_CALL}")
    assert content == PREFACE and [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": " Paris "})]
    # a message to itself left in the reply (its thinking not split off) is text, never a call
    content, calls = _every_split(fmt, " to=self<|message|>hmm<|eom|><|start|>assistant to=user<|message|>ok", ())
    assert content == "hmmok" and calls == []


def test_glimmer_history_renders_the_call_as_the_model_writes_it():
    from tool_families import RESULT

    rendered = ChatTemplate(FAMILIES["muse_glimmer"].template).render(
        messages=history("muse_glimmer"), tools=TOOLS, add_generation_prompt=True
    )
    turn = rendered.split("<|start|>user<|message|>")[1].split("<|eot|>", 1)[1]
    call, result = turn.split("<|eot|>")[0], turn.split("<|eot|>")[1]
    assert call.startswith("<|start|>assistant to=get_weather<|message|>")
    _, calls = read_reply(FORMATS["muse_glimmer"], call[len("<|start|>assistant") :], TOOLS)
    assert [(c.name, c.arguments) for c in calls] == ONE
    assert result == f'<|start|>tool get_weather<|message|><tool_output name="get_weather">\n{RESULT}\n</tool_output>'
    assert rendered.endswith("<|start|>assistant")


FIRST_TURN = [{"role": "user", "content": "hi"}]


def _turn(family: str, **kwargs):
    """The reasoning of a first turn rendered by the family's template, as prepare_chat decides it."""
    fam = FAMILIES[family]
    template = ChatTemplate(fam.template)
    specials = {"bos_token": fam.bos or "", "eos_token": fam.eos}

    def render(add: bool) -> str:
        return template.render(messages=FIRST_TURN, add_generation_prompt=add, **specials, **kwargs)

    reasoning = find_reasoning(fam.template)
    return reasoning, turn_reasoning(reasoning, generation_prompt(render, render(True)), 16)


@pytest.mark.parametrize(
    ("family", "kwargs", "delimiters", "started"),
    [
        ("qwen3_5", {}, ("<think>", "</think>"), True),
        ("qwen3_5", {"enable_thinking": False}, ("<think>", "</think>"), None),
        ("minimax_m2", {}, ("<think>", "</think>"), True),
        ("deepseek_v4", {}, ("<think>", "</think>"), True),  # its user turn ends with the opener: no generation prompt
        ("deepseek_v4", {"enable_thinking": False}, ("<think>", "</think>"), False),
        ("deepseek_v31", {}, ("<think>", "</think>"), False),
        ("deepseek_v31", {"thinking": True}, ("<think>", "</think>"), True),
        ("nemotron", {}, ("<think>", "</think>"), True),
        ("glm45", {}, ("<think>", "</think>"), False),  # the model opens its block itself
        ("glm45", {"enable_thinking": False}, ("<think>", "</think>"), None),
        ("gemma4", {}, ("<|channel>thought", "<channel|>"), None),  # off unless asked: an empty channel is closed
        ("gemma4", {"enable_thinking": True}, ("<|channel>thought", "<channel|>"), False),
        ("hy3", {}, ("<think:opensource>", "</think:opensource>"), None),  # reasoning_effort no_think: closed
        ("hy3", {"reasoning_effort": "high"}, ("<think:opensource>", "</think:opensource>"), True),
        ("muse_glimmer", {}, ("to=self<|message|>", "<|eom|>"), False),  # the model addresses itself or not
    ],
)
def test_each_family_thinks_as_its_generation_prompt_says(family, kwargs, delimiters, started):
    reasoning, turn = _turn(family, **kwargs)
    assert (reasoning.start, reasoning.end) == delimiters
    assert (turn.started if turn is not None else None) == started
    if turn is not None:
        assert turn.budget == 16  # the reasoning budget rides along for the runtime to enforce
