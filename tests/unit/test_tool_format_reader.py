"""Each family's reply format, read from its own chat template: detection, reading, streaming, forced grammar.

The replies are the families' own text (tests/tool_families.py, written from their templates and parsers, not
from ours). Reading is checked whole and at every split of the reply into two chunks, and token by token through
the family's own tokenizer with its markup tokens shown; the forced-call grammar is compiled against that
tokenizer and must accept the family's own writing of a call (and refuse other syntax).
"""

from __future__ import annotations

import re

import pytest
from tool_families import EXPECTED, EXPECTED_TEXT, FAMILIES, TOOLS, family_tokenizer

from exllama_integrations.chat.formats import FORMATS, ReplyReader, find_format, forced_call_grammar, read_reply
from exllama_integrations.chat.formats.grammar import MAX_PARALLEL, write_calls
from exllama_integrations.chat.reasoning import find_reasoning
from exllama_integrations.model.detokenizer import IncrementalDetokenizer

CASES = [(f, k) for f, fam in FAMILIES.items() for k in fam.replies]


def _answer(family: str, reply: str) -> str:
    """The reply less its thinking, as the runtime's reasoning split hands it on."""
    r = find_reasoning(FAMILIES[family].template)
    if r is not None and r.end in reply and (reply.lstrip().startswith(r.start) or FAMILIES[family].thinks_first):
        return reply[reply.find(r.end) + len(r.end) :]
    return reply


def _calls(calls):
    return [(c.name, c.arguments) for c in calls if c.error is None]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_format_is_found_from_the_family_template(family):
    assert find_format(FAMILIES[family].template).name == FAMILIES[family].tool_format


@pytest.mark.parametrize(("family", "key"), CASES)
def test_a_reply_reads_to_its_calls_and_text_at_every_split(family, key):
    fmt = find_format(FAMILIES[family].template)
    text = _answer(family, FAMILIES[family].replies[key])
    content, calls = read_reply(fmt, text, TOOLS)
    assert _calls(calls) == EXPECTED[key] and all(c.error is None for c in calls)
    assert content.strip() == (EXPECTED_TEXT[key][1] or "")
    markup = [m for m in (*fmt.opens, *fmt.closes, *fmt.strip) if len(m) > 1]
    for i in range(len(text) + 1):
        reader = ReplyReader(fmt, TOOLS)
        a, first = reader.feed(text[:i])
        b, second = reader.feed(text[i:])
        c, last = reader.finish()
        assert a + b + c == content
        assert _calls(first + second + last) == EXPECTED[key]
        for shown in (a, b):  # never a whole or partial piece of markup in streamed text
            assert not any(m in shown for m in markup)
            assert not any(shown.endswith(m[:j]) for m in markup for j in range(2, len(m))), (i, shown)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return {name: family_tokenizer(name, root / name) for name in FAMILIES}


@pytest.mark.parametrize(("family", "key"), CASES)
def test_token_by_token_through_the_family_tokenizer(family, key, tokenizers):
    """Decoded as the runtime decodes (its markup tokens shown, other specials hidden), token by token."""
    tok = _tokenizer(tokenizers, family)
    fmt = find_format(FAMILIES[family].template)
    text = _answer(family, FAMILIES[family].replies[key])
    shown = {tok.token_to_id(m): m for m in fmt.markup if tok.token_to_id(m) in tok.special_ids}
    detok = IncrementalDetokenizer(tok, shown=shown)
    reader = ReplyReader(fmt, TOOLS)
    streamed, calls = [], []
    for tid in tok.encode(text, add_special_tokens=False):
        piece, done = reader.feed(detok.add([tid]))
        streamed.append(piece)
        calls += done
    piece, done = reader.finish()
    streamed.append(piece)
    calls += done
    assert _calls(calls) == EXPECTED[key]
    assert "".join(streamed).strip() == (EXPECTED_TEXT[key][1] or "")


def _tokenizer(tokenizers, family):
    return tokenizers[family]


@pytest.mark.parametrize("family", [f for f in FAMILIES if FAMILIES[f].tool_format != "fallback"])
def test_the_forced_grammar_admits_the_family_syntax_and_nothing_else(family, tokenizers):
    """The grammar compiles against the family's tokenizer and accepts its own writing of one and two calls."""
    from exllama_integrations.contract.api import Grammar
    from exllama_integrations.model.grammar import TokenConstraint

    tok = _tokenizer(tokenizers, family)
    fmt = FORMATS[FAMILIES[family].tool_format]

    def token_of(text):
        ids = tok.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    ends = set(tok.eos_token_ids)

    def accepts(grammar: str, text: str) -> bool:
        matcher = TokenConstraint.compile(tok, Grammar.lark(grammar)).matcher()
        ids = tok.encode(text, add_special_tokens=False)
        while ids and ids[-1] in ends:  # the turn's end token is the model's to write once the grammar accepts
            ids = ids[:-1]
        return matcher._matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    one = [("get_weather", {"city": "Paris"})]
    two = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "Europe/Paris"})]
    several = forced_call_grammar(fmt, TOOLS, token_of, parallel=True, ends=ends)
    single = forced_call_grammar(fmt, TOOLS, token_of, parallel=False, ends=ends)
    assert accepts(several, write_calls(fmt, one)) and accepts(single, write_calls(fmt, one))
    assert accepts(several, write_calls(fmt, two)) == fmt.parallel
    assert not accepts(single, write_calls(fmt, two))
    other = FORMATS["fallback"] if fmt.name != "fallback" else FORMATS["mistral"]
    assert not accepts(several, write_calls(other, one))  # another family's syntax is refused
    assert not accepts(several, write_calls(fmt, [("get_time", {})]))  # get_time's timezone is required
    # and what the grammar admits reads back as the calls
    assert _calls(read_reply(fmt, write_calls(fmt, two if fmt.parallel else one), TOOLS)[1]) == (
        two if fmt.parallel else one
    )


@pytest.mark.parametrize("family", [f for f in FAMILIES if FORMATS[FAMILIES[f].tool_format].parallel])
def test_the_forced_grammar_writes_at_most_max_tool_calls(family, tokenizers):
    """``max_tool_calls``: the grammar admits that many calls and not one more (no tokens on calls nobody gets)."""
    tok = _tokenizer(tokenizers, family)
    fmt = FORMATS[FAMILIES[family].tool_format]
    ends = set(tok.eos_token_ids)

    def token_of(text):
        ids = tok.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    def accepts(grammar: str, text: str) -> bool:
        from exllama_integrations.contract.api import Grammar
        from exllama_integrations.model.grammar import TokenConstraint

        matcher = TokenConstraint.compile(tok, Grammar.lark(grammar)).matcher()
        ids = tok.encode(text, add_special_tokens=False)
        while ids and ids[-1] in ends:
            ids = ids[:-1]
        return matcher._matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    cities = ["Paris", "Rome", "Oslo", "Lima", "Kyiv"]
    for most in (1, 2, 3):
        grammar = forced_call_grammar(fmt, TOOLS, token_of, parallel=True, ends=ends, most=most)
        for n in range(1, most + 2):
            text = write_calls(fmt, [("get_weather", {"city": c}) for c in cities[:n]])
            assert accepts(grammar, text) == (n <= most), (most, n, text)
    # past MAX_PARALLEL the grammar's own bound holds; without max_tool_calls, that bound
    many = write_calls(fmt, [("get_weather", {"city": c}) for c in cities[: MAX_PARALLEL + 1]])
    assert not accepts(forced_call_grammar(fmt, TOOLS, token_of, parallel=True, ends=ends, most=99), many)
    enough = write_calls(fmt, [("get_weather", {"city": c}) for c in cities[:MAX_PARALLEL]])
    assert accepts(forced_call_grammar(fmt, TOOLS, token_of, parallel=True, ends=ends), enough)


def test_the_docs_table_names_every_format_and_each_is_a_tested_family():
    from pathlib import Path

    page = (Path(__file__).parents[2] / "docs" / "tool-calls.md").read_text()  # the README links it
    section = page.split("## Tool calls in each family's own format", 1)[1].split("Checked how:", 1)[0]
    rows = [r for r in section.splitlines() if r.startswith("| ") and not r.startswith(("| family", "| ---"))]
    named = [re.search(r"\| `(\w+)` \|", r).group(1) for r in rows]
    assert sorted(named) == sorted(FORMATS)  # every format the package reads is in the table, once
    assert {f.tool_format for f in FAMILIES.values()} == set(FORMATS)  # each has a tested family


# ---------------------------------------------------------------- replies that do not read (issue 49)

PYTHONIC_BAD = {
    "text_after": '[get_weather(city="Paris")] and more text',
    "cut": '[get_weather(city="Par',
    "eos_text": '[get_weather(city="Paris")]</s>',
    "not_a_call": "[get_weather(city=Paris, unit)]",
}


@pytest.mark.parametrize("case", list(PYTHONIC_BAD))
def test_a_pythonic_reply_that_does_not_read_is_an_invalid_call_with_its_text(case):
    fmt, text = FORMATS["pythonic"], PYTHONIC_BAD[case]
    content, [call] = read_reply(fmt, text, TOOLS)  # never an exception, whole or char by char
    assert content == "" and call.error and call.raw == text and call.name == "get_weather"
    reader, calls = ReplyReader(fmt, TOOLS), []
    for ch in text:
        assert reader.feed(ch)[0] == ""
        calls += reader.feed("")[1]
    calls += reader.finish(cut=case == "cut")[1]
    assert [c.raw for c in calls] == [text] and calls[0].error


AWKWARD = {
    "type": "function",
    "function": {
        "name": "get-weather",
        "parameters": {
            "type": "object",
            "properties": {"from": {"type": "string"}, "content-type": {"type": "integer"}, "météo": {}},
            "required": ["from"],
        },
    },
}


def test_pythonic_names_python_would_not_take_read_back_as_the_grammar_writes_them(tokenizers):
    fmt = FORMATS["pythonic"]
    args = {"from": "Paris", "content-type": 3, "météo": [1, None]}
    text = write_calls(fmt, [("get-weather", args)])
    assert text == '[get-weather(from="Paris", content-type=3, météo=[1, null])]'
    assert _calls(read_reply(fmt, text, [AWKWARD])[1]) == [("get-weather", args)]
    tok = tokenizers["llama4_pythonic"]
    grammar = forced_call_grammar(fmt, [AWKWARD], lambda t: None)
    assert _accepts(tok, grammar, text)  # what the grammar admits is what the reader reads


def _accepts(tok, grammar: str, text: str) -> bool:
    from exllama_integrations.contract.api import Grammar
    from exllama_integrations.model.grammar import TokenConstraint

    matcher = TokenConstraint.compile(tok, Grammar.lark(grammar)).matcher()
    ids = tok.encode(text, add_special_tokens=False)
    return matcher._matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def test_names_a_format_cannot_read_back_are_refused_typed():
    from exllama_integrations.chat.formats import check_names
    from exllama_integrations.errors import InvalidSettingsError

    def tool(name, *keys):
        return {"type": "function", "function": {"name": name, "parameters": {"properties": dict.fromkeys(keys, {})}}}

    for fmt, bad in [
        ("pythonic", tool("get weather")),
        ("pythonic", tool("f", "a=b")),
        ("qwen3_coder", tool("f", "a>b")),
        ("mistral_v11", tool("get weather")),
        ("harmony", tool("a b")),
    ]:
        with pytest.raises(InvalidSettingsError, match=f"cannot be called in the {fmt} tool-call format") as e:
            check_names(FORMATS[fmt], [bad])
        assert e.value.param == "tools"
    for fmt in FORMATS.values():  # hyphens, keywords and unicode are fine everywhere
        check_names(fmt, [AWKWARD])


# ---------------------------------------------------------------- Qwen3-Coder values typed by the schema (issue 49)

NULLABLE = {
    "type": "function",
    "function": {
        "name": "find",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": ["string", "null"]},
                "days": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                "tags": {"type": "array", "items": {"type": "string"}},
                "near": {"anyOf": [{"type": "string"}, {"type": "number"}]},
                "note": {"type": "string"},
            },
            "required": ["city"],
        },
    },
}


@pytest.mark.parametrize(
    "args",
    [
        {"city": "Paris", "days": 3, "tags": ["a"], "near": "Lyon", "note": "3"},
        {"city": None, "days": None, "near": 2.5, "note": "null"},
        {"city": "New York"},
    ],
)
def test_qwen3_coder_optional_and_nullable_values_come_back_typed_as_written(args, tokenizers):
    fmt = FORMATS["qwen3_coder"]
    text = write_calls(fmt, [("find", args)])
    assert _calls(read_reply(fmt, text, [NULLABLE])[1]) == [("find", args)]
    tok = tokenizers["qwen3_coder"]

    def token_of(t):
        ids = tok.encode(t, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    assert _accepts(tok, forced_call_grammar(fmt, [NULLABLE], token_of), text)
