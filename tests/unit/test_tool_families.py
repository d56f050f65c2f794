"""The tool-calling family fixtures are what they claim: their templates render agent histories in the package's
sandbox, their replies are made of the family's own tokens and come back from the tokenizer byte for byte.

Tokenizers only (no weights): each family's tokenizer files are written once for the module.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer
from tool_families import EXPECTED, EXPECTED_TEXT, FAMILIES, TOOLS, Family, TokenizerFiles, history, make_tokenizer

from exllama_integrations.chat.formats import FORMATS
from exllama_integrations.chat.history import fallback_history, family_ids, native_history
from exllama_integrations.errors import ChatTemplateError
from exllama_integrations.model.tokenizer import NativeTokenizer

NAMES = sorted(FAMILIES)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tool_families")
    return {n: make_tokenizer(n, root / n) for n in NAMES}


def _native(family: Family) -> bool:
    return family.tool_format != "fallback"


@pytest.mark.parametrize("name", NAMES)
def test_template_renders_tools_and_an_agent_history(dirs: dict[str, Path], name: str) -> None:
    family = FAMILIES[name]
    tok = NativeTokenizer(TokenizerFiles(dirs[name]))
    # the runtime hands templates histories as native_history / fallback_history leave them, from OpenAI's form
    if _native(family):  # arguments as the family's template takes them (DeepSeek-V3.1's joins JSON text with +)
        as_json = FORMATS[family.tool_format].history_arguments == "json"
        messages = native_history(
            family_ids(history(family, json_arguments=True), FORMATS[family.tool_format].ids), as_json
        )
    else:
        messages = fallback_history(history(family, json_arguments=True))
    tools = TOOLS if _native(family) else None
    prompt = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
    first = tok.apply_chat_template(messages[:1], tools=tools, add_generation_prompt=True)
    if _native(family):
        assert "get_time" in first and "get_weather" in first  # the template lists the tools itself
    assert "temperature" in prompt and "Paris" in prompt  # the earlier call and its result are there
    assert prompt.count("get_weather") > first.count("get_weather")
    if family.bos:
        assert prompt.startswith(family.bos)
    # the family's control tokens in the prompt are read as the tokens they are, never as their letters
    ids = tok.encode(prompt)
    for t in (*family.specials, *family.plain):
        assert ids.count(tok.token_to_id(t)) == prompt.count(t), t


@pytest.mark.parametrize("name", NAMES)
def test_replies_are_the_familys_tokens_and_round_trip(dirs: dict[str, Path], name: str) -> None:
    family = FAMILIES[name]
    tok = Tokenizer.from_file(str(dirs[name] / "tokenizer.json"))
    added = {t: tok.token_to_id(t) for t in (*family.specials, *family.plain)}
    assert None not in added.values()
    assert set(family.replies) <= set(EXPECTED) and {"one", "two", "answer"} <= set(family.replies)
    assert ("think_then_call" in family.replies) == (family.thinking is not None)
    for key, reply in family.replies.items():
        ids = tok.encode(reply, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == reply, key
        for text, tid in added.items():  # each control token in the reply is one token, never split into text
            assert ids.count(tid) == reply.count(text), (key, text)
        shown = tok.decode(ids, skip_special_tokens=True)
        assert not any(t in shown for t in family.specials), (key, shown)
        assert all(shown.count(t) == reply.count(t) for t in family.plain), (key, shown)
        for fn, args in EXPECTED[key]:
            assert fn in reply and all(str(v) in reply for v in args.values()), key
        reasoning, content = EXPECTED_TEXT[key]
        for text in (reasoning, content):
            assert text is None or text in reply, key


def test_eos_and_stops_end_a_turn(dirs: dict[str, Path]) -> None:
    for name in NAMES:
        family = FAMILIES[name]
        tok = NativeTokenizer(TokenizerFiles(dirs[name]))
        ends = [tok.token_to_id(t) for t in (family.eos, *family.stops)]
        assert tok.eos_token_ids[: len(ends)] == ends, name


@pytest.mark.parametrize("name", ["mistral", "magistral", "mistral_small32"])
def test_mistral_ids_are_nine_alphanumerics(dirs: dict[str, Path], name: str) -> None:
    family = FAMILIES[name]
    assert len(family.call_id) == 9 and family.call_id.isalnum()
    if name == "magistral":
        return  # its template writes no ids
    tok = NativeTokenizer(TokenizerFiles(dirs[name]))
    for bad in ("call_abc123", "abc12345", "abc-12345"):
        messages = history(family)
        messages[1]["tool_calls"][0]["id"] = bad
        messages[2]["tool_call_id"] = bad
        with pytest.raises(ChatTemplateError, match="alphanumeric strings with length 9"):
            tok.apply_chat_template(messages, tools=TOOLS)
        messages[1]["tool_calls"][0]["id"] = family.call_id  # a bad id on the result alone is refused too
        with pytest.raises(ChatTemplateError, match="alphanumeric strings with length 9"):
            tok.apply_chat_template(messages, tools=TOOLS)


def test_llama3_refuses_two_calls_in_one_earlier_turn(dirs: dict[str, Path]) -> None:
    tok = NativeTokenizer(TokenizerFiles(dirs["llama3"]))
    messages = history("llama3")
    messages[1]["tool_calls"] = messages[1]["tool_calls"] * 2
    with pytest.raises(ChatTemplateError, match="single tool-calls"):
        tok.apply_chat_template(messages, tools=TOOLS)
