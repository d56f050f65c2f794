"""Chat finished once: the streamer's deltas and outcome, and both frameworks' conversion of them.

Each behaviour is asserted on LangChain's chunks and LlamaIndex's responses alike.
"""

from __future__ import annotations

import pytest

from exllama_integrations import ConstraintViolationError, GenerationSettings, Grammar
from exllama_integrations.chat.outcome import ChatDelta, ChatOutcome, ChatStreamer
from exllama_integrations.chat.prepare import PreparedChat
from exllama_integrations.contract.api import GenerationRequest, StreamChunk, Timings, TokenLogprob, TopLogprob, Usage
from exllama_integrations.contract.shapes import metadata

TOOLS = ({"type": "function", "function": {"name": "add", "parameters": {}}},)
FINAL = StreamChunk("", (), None, "eos", Usage(3, 9), Timings(0.1, 1.0, 10.0))


def _items(pieces, tools: bool, final: StreamChunk = FINAL, grammar=None):
    prepared = PreparedChat(GenerationRequest("prompt", GenerationSettings(), grammar=grammar), TOOLS if tools else ())
    s = ChatStreamer(prepared, model_name="m", backend="b")
    out = [s.feed(StreamChunk(p)) for p in pieces]
    out.append(s.feed(final))
    return [i for i in out if i is not None]


def _langchain(items):
    from exllama_integrations.langchain.messages import lc_chat_chunk

    chunks = [lc_chat_chunk(i, False) for i in items]
    full = chunks[0].message
    for c in chunks[1:]:
        full = full + c.message
    shown = [c.message.content for c in chunks[:-1] if c.message.content]
    calls = [(c["name"], c["args"]) for c in full.tool_calls]
    invalid = [(c["name"], c["args"]) for c in full.invalid_tool_calls]
    return shown, full.content, calls, invalid, full.response_metadata["finish_reason"]


def _llama_index(items):
    import json

    from exllama_integrations.llama_index.llms import ExLlamaLLM

    acc, responses, seen = "", [], []
    for i in items:
        acc += i.text if isinstance(i, ChatDelta) else ""
        responses.append(ExLlamaLLM._chat_response(acc, i, seen))
    shown = [r.delta for r in responses[:-1] if r.delta]
    last = responses[-1]
    calls = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in last.message.additional_kwargs.get("tool_calls", [])
    ]
    invalid = [(c["name"], c["raw"]) for c in last.message.additional_kwargs.get("invalid_tool_calls", [])]
    return shown, last.message.content, calls, invalid, last.raw["finish_reason"]


FRAMEWORKS = [pytest.param(_langchain, id="langchain"), pytest.param(_llama_index, id="llama_index")]


@pytest.mark.parametrize("convert", FRAMEWORKS)
def test_text_then_a_tool_call_split_across_chunks(convert):
    items = _items(["Sure, <tool", '_call>{"name": "add", ', '"arguments": {"a": 1, "b": 2}}</tool_call>'], True)
    shown, content, calls, invalid, finish = convert(items)
    assert shown == ["Sure, "]  # the partial tag was held, never shown
    assert content == "Sure, "  # what was streamed; the call is not part of the content
    assert calls == [("add", {"a": 1, "b": 2})] and not invalid
    assert finish == "tool_calls"


@pytest.mark.parametrize("convert", FRAMEWORKS)
def test_a_false_start_of_the_tag_is_released(convert):
    shown, content, calls, _, finish = convert(_items(["a <to", "y> b"], True))
    assert content == "a <toy> b" == "".join(shown) and not calls and finish == "stop"


@pytest.mark.parametrize("convert", FRAMEWORKS)
def test_malformed_call_becomes_an_invalid_tool_call(convert):
    _, _, calls, invalid, _ = convert(_items(['<tool_call>{"name": "add", "arguments": {"a": </tool_call>'], True))
    assert not calls and invalid and invalid[0][0] == "add"


@pytest.mark.parametrize("convert", FRAMEWORKS)
def test_without_tools_the_tag_is_plain_text(convert):
    shown, content, calls, _, _ = convert(_items(["<tool_call>x</tool_call>"], False))
    assert content == "<tool_call>x</tool_call>" and not calls
    assert "".join(shown) == content


def test_outcome_carries_usage_and_both_finish_names():
    out = _items(["hi"], False, StreamChunk("", (), None, "length", Usage(3, 9), Timings(0.1, 1.0, 10.0)))[-1]
    assert isinstance(out, ChatOutcome)
    assert (out.finish_reason, out.native_finish_reason) == ("length", "length")
    assert out.metadata["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 9,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }
    assert _items(["hi"], False)[-1].metadata["finish_reason"] == "stop"  # eos is reported OpenAI-style


def test_a_constrained_reply_cut_short_raises():
    cut = StreamChunk("", (), None, "length", Usage(3, 9), Timings(0.1, 1.0, 10.0), constraint_complete=False)
    with pytest.raises(ConstraintViolationError, match="raise max_tokens"):
        _items(['{"a": '], False, cut, grammar=Grammar.json_schema({"type": "object"}))


def test_metadata_logprobs_are_openai_shaped():
    lp = TokenLogprob(5, "hi", -0.5, (TopLogprob(5, "hi", -0.5), TopLogprob(6, "yo", -1.5)))
    md = metadata(FINAL, model_name="m", backend="b", logprobs=[lp])
    assert md["logprobs"] == {
        "content": [
            {
                "token": "hi",
                "logprob": -0.5,
                "bytes": [104, 105],
                "top_logprobs": [
                    {"token": "hi", "logprob": -0.5, "bytes": [104, 105]},
                    {"token": "yo", "logprob": -1.5, "bytes": [121, 111]},
                ],
            }
        ]
    }


def test_a_forced_reply_announces_no_call_past_max_tool_calls():
    """The forced grammar writes at most ``max_tool_calls`` calls; should a reply hold more (another grammar, a
    backend that ignores it), no call past the bound is announced by an argument delta: a client is never told of a
    call it will not get."""
    from exllama_integrations.chat.formats import FORMATS

    prepared = PreparedChat(
        GenerationRequest("prompt", GenerationSettings()), TOOLS, FORMATS["hermes"], forced=True, max_calls=1
    )
    s = ChatStreamer(prepared, model_name="m", backend="b")
    call = '<tool_call>\n{"name": "add", "arguments": {"a": %d}}\n</tool_call>'
    reply = call % 1 + "\n" + call % 2
    items = [s.feed(StreamChunk(reply[i : i + 5])) for i in range(0, len(reply), 5)]
    outcome = s.feed(FINAL)
    deltas = [a for i in items if isinstance(i, ChatDelta) for a in i.arguments]
    assert deltas and {a.index for a in deltas} == {0}
    assert "".join(a.delta for a in deltas) == '{"a": 1}'
    assert isinstance(outcome, ChatOutcome) and [c.arguments for c in outcome.tool_calls] == [{"a": 1}]
