"""A checkpoint's own ``response_template`` (transformers 5.x) reads its replies' tool calls, streamed or whole.

The templates are transformers' own shapes (Gemma 4's ``<|tool_call>call:NAME{...}<tool_call|>`` with its
``<|"|>`` strings; Qwen 3.5's XML parameters): read by transformers' ``ResponseParser`` through our reader, with
the same guarantees as the family table: no partial tag in the streamed text, a region that does not read is an
invalid call with its text, one cut by ``max_tokens`` says so, values typed by the tool's schema.
"""

from __future__ import annotations

import logging

from exllama_integrations.chat.formats import ReplyReader, find_format, read_reply, response_template_of

GEMMA4 = {
    "defaults": {"role": "assistant"},
    "start_anchor": ["<|turn>model\n", "<tool_response|>"],
    "fields": {
        "tool_calls": {
            "open_pattern": r"<\|tool_call>call:(?P<name>\w+)",
            "close": "<tool_call|>",
            "repeats": True,
            "content": "json",
            "content_args": {"unquoted_keys": True, "string_delims": [['<|"|>', '<|"|>']]},
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {"close": ["<turn|>", "<eos>"], "content": "text"},
    },
}
QWEN35_XML = {
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open_pattern": r"\s*<tool_call>\s*<function=(?P<name>[^>\n]+)>",
            "close_pattern": r"</function>\s*</tool_call>",
            "repeats": True,
            "content": "xml-inline",
            "content_args": {"tag_pattern": r"<parameter=(?P<key>[^>\n]+)>\s*(?P<value>.*?)\s*</parameter>"},
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {"content": "text"},
    },
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
        },
    }
]
GEMMA_REPLY = (
    'Let me check.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>'
    '<|tool_call>call:get_time{timezone:<|"|>Europe/Paris<|"|>}<tool_call|>'
)


def _fmt(spec):
    return find_format(None, "hermes", response_template_of({"response_template": spec}))


def test_streamed_by_the_character_is_read_as_whole_with_no_partial_tag():
    fmt = _fmt(GEMMA4)
    reader = ReplyReader(fmt, TOOLS)
    shown, calls = [], []
    for ch in GEMMA_REPLY:
        text, new = reader.feed(ch)
        shown.append(text)
        calls += new
    text, new = reader.finish()
    shown.append(text)
    calls += new
    assert "".join(shown) == "Let me check." and not any("<" in s for s in shown)
    whole_text, whole = read_reply(fmt, GEMMA_REPLY, TOOLS)
    assert whole_text == "Let me check."
    expected = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"timezone": "Europe/Paris"})]
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole] == expected
    assert all(c.error is None and c.id.startswith("call_") for c in calls)


def test_xml_values_are_typed_by_the_tool_schema():
    reply = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
    reply += "</parameter>\n</function>\n</tool_call>"
    text, [call] = read_reply(_fmt(QWEN35_XML), reply, TOOLS)
    assert text == "" and (call.name, call.arguments) == ("get_weather", {"city": "Paris", "days": 3})


def test_a_region_that_does_not_read_is_an_invalid_call_and_a_cut_one_says_so():
    fmt = _fmt(GEMMA4)
    text, [bad] = read_reply(fmt, "<|tool_call>call:get_weather{city:}<tool_call|>Sorry.")
    assert text == "Sorry." and bad.name == "get_weather" and bad.arguments is None and "json" in (bad.error or "")
    assert bad.raw == "{city:}"
    reader = ReplyReader(fmt)
    assert reader.feed('<|tool_call>call:get_weather{city:<|"|>Pa') == ("", [])
    _, [cut] = reader.finish(cut=True)
    assert cut.error == "cut off by max_tokens before the call was complete"


def test_what_a_model_info_takes_from_tokenizer_config(caplog):
    assert response_template_of({}) is None
    no_calls = {"start_anchor": "x", "fields": {"content": {"content": "text"}}}
    assert response_template_of({"response_template": no_calls}) is None  # nothing to read calls with
    with caplog.at_level(logging.WARNING):
        assert response_template_of({"response_template": {**GEMMA4, "regions": {}}}) is None
    assert "does not load" in caplog.text  # an unknown key: transformers refuses it, the table reads instead
    fmt = _fmt(GEMMA4)
    assert fmt.name == "hermes" and fmt.response_template == GEMMA4  # the family's entry still writes calls
    assert "<tool_call|>" in fmt.markup and "<turn|>" in fmt.markup  # shown in the decoded text, to be read
    assert find_format(None, "hermes").response_template is None
