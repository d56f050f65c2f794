"""The contract's wire form: every value survives JSON both ways, readers are forward-compatible and typed."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exllama_integrations import errors
from exllama_integrations.contract import wire
from exllama_integrations.contract.api import (
    GenerationRequest,
    GenerationResult,
    Grammar,
    Media,
    ModelInfo,
    Reasoning,
    StreamChunk,
    Timings,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from exllama_integrations.contract.settings import GenerationSettings

from helpers import error_instances

text = st.text(max_size=40)
small = st.integers(min_value=0, max_value=10_000)
finite = st.floats(allow_nan=False, allow_infinity=False, width=32)

settings_values = st.builds(
    GenerationSettings,
    max_new_tokens=st.one_of(st.none(), st.integers(1, 4096)),
    temperature=st.floats(0, 2),
    top_k=st.integers(0, 100),
    top_p=st.floats(0.01, 1.0),
    seed=st.one_of(st.none(), st.integers(0, 2**40)),
    stop=st.lists(st.text(min_size=1, max_size=8), max_size=3),
    stop_token_ids=st.lists(small, max_size=3),
    logprobs=st.one_of(st.none(), st.integers(0, 20)),
    max_reasoning_tokens=st.one_of(st.none(), st.integers(1, 100)),
)
grammars = st.one_of(
    st.none(),
    st.builds(Grammar.regex, st.text(min_size=1, max_size=10)),
    st.builds(Grammar.json_schema, st.fixed_dictionaries({"type": st.just("object")})),
)
reasonings = st.one_of(
    st.none(),
    st.builds(
        Reasoning,
        start=st.text(min_size=1, max_size=8),
        end=st.text(min_size=1, max_size=8),
        started=st.booleans(),
        budget=st.one_of(st.none(), st.integers(1, 500)),
    ),
)
requests = st.builds(
    GenerationRequest,
    prompt=st.one_of(text, st.lists(small, max_size=8).map(tuple)),
    settings=settings_values,
    grammar=grammars,
    add_special_tokens=st.booleans(),
    reasoning=reasonings,
    media=st.lists(st.builds(Media, st.binary(max_size=32), st.one_of(st.none(), text)), max_size=2).map(tuple),
    incremental=st.booleans(),
)
logprobs = st.one_of(
    st.none(),
    st.lists(
        st.builds(
            TokenLogprob,
            small,
            text,
            finite,
            st.lists(st.builds(TopLogprob, small, text, finite), max_size=2).map(tuple),
        ),
        max_size=3,
    ).map(tuple),
)
usages = st.builds(Usage, small, small, small, small)
timings = st.builds(Timings, st.one_of(st.none(), finite), finite, st.one_of(st.none(), finite))
chunks = st.builds(
    StreamChunk,
    text=text,
    token_ids=st.lists(small, max_size=5).map(tuple),
    logprobs=logprobs,
    finish_reason=st.sampled_from([None, "eos", "stop", "length", "cancelled"]),
    usage=st.one_of(st.none(), usages),
    timings=st.one_of(st.none(), timings),
    stop_string=st.one_of(st.none(), text),
    constraint_complete=st.one_of(st.none(), st.booleans()),
    reasoning=text,
)
results = st.builds(
    GenerationResult,
    text=text,
    finish_reason=st.sampled_from(["eos", "stop", "length", "cancelled"]),
    usage=usages,
    timings=timings,
    token_ids=st.lists(small, max_size=5).map(tuple),
    logprobs=logprobs,
    backend=text,
    reasoning=text,
)
infos = st.builds(
    ModelInfo,
    name=text,
    backend=text,
    context_length=st.integers(1, 1 << 20),
    vocab_size=st.integers(1, 1 << 18),
    eos_token_ids=st.lists(small, max_size=3).map(tuple),
    reasoning=reasonings,
    accepts_images=st.booleans(),
    unsupported_settings=st.dictionaries(text, text, max_size=2),
    details=st.dictionaries(text, st.one_of(small, text), max_size=3),
)


@settings(max_examples=60, deadline=None)
@given(requests)
def test_a_request_survives_the_wire(request: GenerationRequest):
    assert wire.loads_request(wire.dumps(request)) == request


@settings(max_examples=60, deadline=None)
@given(chunks)
def test_a_chunk_survives_the_wire(chunk: StreamChunk):
    assert wire.loads_chunk(wire.dumps(chunk)) == chunk


@settings(max_examples=40, deadline=None)
@given(results)
def test_a_result_survives_the_wire(result: GenerationResult):
    assert wire.loads_result(wire.dumps(result)) == result


@settings(max_examples=40, deadline=None)
@given(infos)
def test_model_info_survives_the_wire(info: ModelInfo):
    assert wire.loads_info(wire.dumps(info)) == info


def test_a_reader_ignores_fields_it_does_not_know_but_never_a_setting():
    data = json.loads(wire.dumps(GenerationRequest("hi", GenerationSettings(max_tokens=3))))
    data["a_field_from_a_newer_client"] = {"x": 1}
    assert wire.loads_request(data).settings.max_new_tokens == 3
    chunk = {**wire.to_data(StreamChunk("a")), "new": [1, 2]}
    assert wire.loads_chunk(chunk).text == "a"  # an older client reads a newer server
    data["settings"]["temprature"] = 0.5
    with pytest.raises(errors.InvalidSettingsError, match="temprature"):
        wire.loads_request(data)  # a setting is never dropped silently


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ('{"prompt": 5}', "prompt"),
        ('{"prompt": "x", "grammar": {"kind": "bad", "source": "s"}}', "grammar.kind"),
        ('{"prompt": "x", "media": [{"data": "!!!"}]}', "media"),
        ('{"prompt": "x", "messages": [{"role": "user", "content": "y"}]}', "prompt or messages"),
        ("not json", "invalid request"),
        ("[" * 100_000, "invalid request"),
    ],
)
def test_a_bad_request_is_refused_typed_and_says_where(data: str, match: str):
    with pytest.raises(errors.InvalidSettingsError, match=match):
        wire.loads_request(data)


def test_what_a_server_sends_badly_is_a_protocol_error():
    with pytest.raises(errors.ProtocolError, match="stream chunk"):
        wire.loads_chunk('{"text": 5}')
    with pytest.raises(errors.ProtocolError, match="model info"):
        wire.loads_info({"name": "m"})
    with pytest.raises(errors.ProtocolError):
        wire.loads_chunk(b" " * (wire.MAX_EVENT_BYTES + 1))


@pytest.mark.parametrize("error", error_instances(), ids=lambda e: type(e).__name__)
def test_every_typed_error_comes_back_as_its_own_class_with_its_fields(error: errors.ExLlamaIntegrationsError):
    back = wire.loads_error(wire.dumps_error(error), type(error).status)
    assert type(back) is type(error)
    assert str(back) == str(error) and back.wire_fields() == error.wire_fields()
    assert isinstance(back, errors.ExLlamaIntegrationsError)


def test_the_error_table_is_one_table_in_both_directions():
    codes = [cls.code for cls in errors.ERRORS.values()]
    assert len(codes) == len(set(codes))
    assert all(errors.ERRORS[cls.code] is cls for cls in errors.ERRORS.values())
    unknown = wire.loads_error({"error": {"code": "from_the_future", "message": "new"}}, 500)
    assert isinstance(unknown, errors.ServerError) and "new" in str(unknown)
    assert isinstance(wire.loads_error(b"<html>oops</html>", 502), errors.ProtocolError)


def test_engine_frames_round_trip_and_bad_ones_are_typed():
    from exllama_integrations.backends.base import RawLogprob, TokenStep
    from exllama_integrations.errors import ContextLengthError, GenerationError, ProtocolError
    from exllama_integrations.runtime.engine.wire import pack, step_from_wire, step_to_wire, unpack

    step = TokenStep(
        (5, 6), (RawLogprob(5, -0.5, ((5, -0.5), (7, -1.0))), RawLogprob(6, -0.1)), "length", None, 3, True
    )
    rid, back = step_from_wire(unpack(pack({"op": "steps", "steps": [step_to_wire(9, step, "x")]}))["steps"][0])
    assert (rid, back) == (9, step)
    for last in (
        TokenStep((7,), finish="length", drafted=(12, 3)),
        TokenStep((7,), drafted=(0, 0), prompt_logprobs=()),
    ):
        assert step_from_wire(unpack(pack({"op": "steps", "steps": [step_to_wire(2, last, "x")]}))["steps"][0]) == (
            2,
            last,
        )
    failed = TokenStep(finish="error", error=ContextLengthError(900, 200, 1024))
    error = step_from_wire(step_to_wire(1, failed, "x"))[1].error
    assert isinstance(error, ContextLengthError) and error.context_length == 1024  # its fields cross too
    crashed = step_from_wire(step_to_wire(1, TokenStep(finish="error", error=KeyError("k")), "x"))[1]
    assert isinstance(crashed.error, GenerationError) and "KeyError" in str(crashed.error)
    for bad in (b"not json", b"[1, 2]", b'{"no": "op"}'):
        with pytest.raises(ProtocolError):
            unpack(bad)
    for row in ([1, 2], "x", [1, ["a"], None, None, None, None, None]):
        with pytest.raises(ProtocolError):
            step_from_wire(row)
