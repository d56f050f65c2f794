"""ChatExLlama's chunk builder: text before a tool call streams, the call itself becomes tool_call_chunks."""

from exllama_integrations.langchain.chat_models import _ChunkBuilder
from exllama_integrations.runtime import GenerationChunk, GenerationSettings
from exllama_integrations.runtime.chat import ChatRequest
from exllama_integrations.runtime.runtime import Timings, Usage


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return ""


def _run(pieces: list[str], tools_active: bool):
    b = _ChunkBuilder(ChatRequest("prompt", tools_active=tools_active), GenerationSettings(), "m", _Tok())
    out = [b.feed(GenerationChunk(p)) for p in pieces]
    out.append(b.feed(GenerationChunk("", (), None, "eos", Usage(3, 9), Timings(0.1, 1.0, 10.0))))
    chunks = [c for c in out if c is not None]
    full = chunks[0].message
    for c in chunks[1:]:
        full = full + c.message
    return chunks, full


def test_text_then_a_tool_call_split_across_chunks():
    chunks, full = _run(["Sure, <tool", '_call>{"name": "add", ', '"arguments": {"a": 1, "b": 2}}</tool_call>'], True)
    assert [c.message.content for c in chunks[:-1]] == ["Sure, "]  # the partial tag was held, never shown
    assert full.content == "Sure, "  # what was streamed; the call is not part of the content
    assert full.tool_calls == [
        {"name": "add", "args": {"a": 1, "b": 2}, "id": full.tool_calls[0]["id"], "type": "tool_call"}
    ]
    assert full.response_metadata["finish_reason"] == "tool_calls"
    assert full.usage_metadata["input_tokens"] == 3 and full.usage_metadata["output_tokens"] == 9


def test_a_false_start_of_the_tag_is_released():
    chunks, full = _run(["a <to", "y> b"], True)
    assert full.content == "a <toy> b" and not full.tool_calls


def test_malformed_call_becomes_an_invalid_tool_call():
    _, full = _run(['<tool_call>{"name": "add", "arguments": {"a": </tool_call>'], True)
    assert not full.tool_calls and full.invalid_tool_calls[0]["name"] == "add"
    assert full.invalid_tool_calls[0]["args"].startswith("<tool_call>")  # the raw text, not a repaired call


def test_without_tools_the_tag_is_plain_text():
    _, full = _run(["<tool_call>x</tool_call>"], False)
    assert full.content == "<tool_call>x</tool_call>" and not full.tool_calls
