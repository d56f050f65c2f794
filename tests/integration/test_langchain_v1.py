"""What a LangChain v1 / LlamaIndex user reaches for first works as they spell it (issue 33 8-13, issue 34 7).

Configurable fields by any name the constructor takes, ``model_kwargs``, ``init_chat_model`` and ``ChatOpenAI`` with
streamed usage against the server (the lines of the README and docs/langchain.md, run), ``json_mode`` held to its
schema, transformers' load bar by our rule, and one setting under two names refused the same way at every door.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from langchain_core.runnables import ConfigurableField

from exllama_integrations.contract import wire
from exllama_integrations.contract.settings import GenerationSettings, build_settings
from exllama_integrations.errors import InvalidSettingsError, ModelNotFoundError
from exllama_integrations.langchain import ChatExLlama, ExLlamaLLM
from exllama_integrations.llama_index import ExLlamaLLM as LlamaIndexExLlama

ROOT = Path(__file__).parents[2]
DOCS = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
MODEL = "SmolLM2-135M-Instruct"
Q = "What is the capital of France?"


@pytest.fixture(scope="module")
def chat(demo_runtime) -> ChatExLlama:
    return ChatExLlama(runtime=demo_runtime, temperature=0, max_tokens=12)


# ----------------------------------------------------------------- item 8: configurable fields


@pytest.mark.parametrize("name", ["max_tokens", "num_predict", "max_new_tokens"])
def test_configurable_fields_take_every_name_the_constructor_takes(chat, name):
    budget = chat.configurable_fields(**{name: ConfigurableField(id="budget")})
    msg = budget.with_config(configurable={"budget": 2}).invoke(Q)
    assert msg.usage_metadata["output_tokens"] == 2 and msg.response_metadata["finish_reason"] == "length"
    assert chat.max_new_tokens == 12  # the instance itself is unchanged


def test_configurable_aliases_of_other_settings_and_the_llm(demo_runtime, chat):
    for name in ("typical_p", "repeat_penalty", "thinking_budget", "max_completion_tokens"):
        specs = chat.configurable_fields(**{name: ConfigurableField(id=name)}).config_specs
        assert [s.id for s in specs] == [name]
    llm = ExLlamaLLM(runtime=demo_runtime, temperature=0, max_tokens=12)
    short = llm.configurable_fields(max_tokens=ConfigurableField(id="n")).with_config(configurable={"n": 1})
    assert len(demo_runtime.encode(short.invoke("One, two,"))) <= 2


def test_configurable_field_that_is_no_field_is_refused_in_one_line(chat):
    with pytest.raises(InvalidSettingsError) as e:
        chat.configurable_fields(max_tokenz=ConfigurableField(id="x"))
    text = str(e.value)
    assert "\n" not in text and "profile" not in text and "'max_tokens'" in text
    with pytest.raises(InvalidSettingsError, match="model_kwargs"):  # a setting without a field: where it goes
        chat.configurable_fields(logit_bias=ConfigurableField(id="x"))


# ----------------------------------------------------------------- item 9: model_kwargs, model=


def test_model_kwargs_are_settings(demo_runtime):
    token = demo_runtime.encode(" Paris")[0]
    chat = ChatExLlama(runtime=demo_runtime, temperature=0, model_kwargs={"max_tokens": 3, "logit_bias": {token: 100}})
    assert chat.max_new_tokens == 3  # a setting with a field of its own is that field
    msg = chat.invoke(Q)
    assert msg.usage_metadata["output_tokens"] == 3 and msg.content == demo_runtime.decode([token] * 3)
    li = LlamaIndexExLlama(runtime=demo_runtime, temperature=0, model_kwargs={"num_predict": 2})
    assert li.max_new_tokens == 2


def test_model_kwargs_unknown_or_repeated_keys_are_refused(demo_runtime):
    with pytest.raises(InvalidSettingsError, match=r"'max_tokenz' \(did you mean 'max_tokens'\?\)"):
        ChatExLlama(runtime=demo_runtime, model_kwargs={"max_tokenz": 3})
    with pytest.raises(InvalidSettingsError, match="'temperature' is given twice"):
        ChatExLlama(runtime=demo_runtime, temperature=0, model_kwargs={"temperature": 0.5})
    with pytest.raises(InvalidSettingsError, match="must be a dict"):
        ChatExLlama(runtime=demo_runtime, model_kwargs=["temperature"])


def test_model_with_a_served_name_says_to_pass_base_url():
    with pytest.raises(ModelNotFoundError, match="base_url="):
        ChatExLlama(model="SmolLM2-served-name")


# ----------------------------------------------------------------- issue 34 item 7: one setting, two names

PAIRS = [
    ({"max_tokens": 4, "max_new_tokens": 5}, "max_new_tokens"),
    ({"num_predict": 4, "max_tokens": 5}, "max_tokens"),
    ({"thinking_budget": 4, "max_reasoning_tokens": 5}, "max_reasoning_tokens"),
    ({"typical_p": 0.5, "typical": 0.6}, "typical"),
]


def _names_both(e: pytest.ExceptionInfo, pair: dict) -> None:
    first, second = pair
    assert f"{first!r} and {second!r} are two names for one setting" in str(e.value)


@pytest.mark.parametrize(("pair", "second"), PAIRS)
def test_two_names_for_one_setting_are_one_typed_error_at_every_door(demo_runtime, chat, pair, second):
    with pytest.raises(InvalidSettingsError) as e:
        ChatExLlama(runtime=demo_runtime, **pair)
    _names_both(e, pair)
    assert e.value.param == second
    with pytest.raises(InvalidSettingsError) as e:
        LlamaIndexExLlama(runtime=demo_runtime, **pair)
    _names_both(e, pair)
    with pytest.raises(InvalidSettingsError) as e:
        chat.invoke(Q, **pair)  # per call: refused, not the last name kept
    _names_both(e, pair)
    with pytest.raises(InvalidSettingsError) as e:
        GenerationSettings().merged(**pair)
    _names_both(e, pair)
    with pytest.raises(InvalidSettingsError) as e:
        build_settings(pair)
    _names_both(e, pair)
    with pytest.raises(InvalidSettingsError) as e:  # the native wire's request
        wire.loads_request({"prompt": "x", "settings": pair})
    _names_both(e, pair)


def test_two_names_for_one_setting_on_the_openai_wire_say_the_same():
    import httpx
    from servers import demo_server

    body = {"prompt": "x", "max_tokens": 2, "thinking_token_budget": 4, "max_reasoning_tokens": 5}
    r = httpx.post(demo_server() + "/v1/completions", json=body, timeout=60)
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "duplicate_setting" and error["param"] == "max_reasoning_tokens"
    with pytest.raises(InvalidSettingsError) as e:
        build_settings({"thinking_token_budget": 4, "max_reasoning_tokens": 5})
    assert error["message"] == str(e.value)  # the words of every other door


# ----------------------------------------------------------------- item 11: json_mode with a schema


def test_json_mode_with_a_schema_is_held_to_it(chat):
    schema = {
        "title": "Capital",
        "type": "object",
        "properties": {"city": {"type": "string"}, "is_capital": {"type": "boolean"}},
        "required": ["city", "is_capital"],
        "additionalProperties": False,
    }
    out = chat.with_structured_output(schema, method="json_mode").invoke(Q + " Answer in JSON.", max_tokens=40)
    assert set(out) == {"city", "is_capital"} and isinstance(out["is_capital"], bool)


# ------------------------------------------------- items 10 and 13: the routes the README and docs/ show, run


def _readme_code(pattern: str, url: str) -> str:
    found = re.findall(pattern, DOCS)
    assert len(found) == 1, pattern
    return found[0].replace("http://127.0.0.1:8000", url).replace("<served name>", MODEL)


def test_readme_routes_to_the_server_stream_usage(demo_runtime, chat):
    from langchain.chat_models import init_chat_model  # noqa: F401  (docs/langchain.md's line uses it)
    from langchain_openai import ChatOpenAI  # noqa: F401
    from servers import demo_server

    url = demo_server()
    direct = chat.invoke(Q)
    for pattern in (
        r"`(init_chat_model\(\"openai:[^`]*stream_usage=True\))`",
        r"`(ChatOpenAI\([^`]*stream_usage=True\))`",
    ):
        model = eval(_readme_code(pattern, url))  # the docs' own line (README or docs/)
        model = model.bind(temperature=0, max_tokens=12)
        chunks = list(model.stream(Q))
        assert "".join(c.content for c in chunks) == direct.content  # the same model and template either way
        usage = [c.usage_metadata for c in chunks if c.usage_metadata]
        assert len(usage) == 1  # streamed usage, once, as in process
        assert usage[0]["input_tokens"] == direct.usage_metadata["input_tokens"]
        assert usage[0]["output_tokens"] == direct.usage_metadata["output_tokens"]


# ----------------------------------------------------------------- item 12: transformers' load bar


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from fixture_models import Shape, make_llama

    shape = Shape(hidden=64, layers=1, heads=2, kv_heads=2, inter=128, vocab=300)
    return make_llama(tmp_path_factory.mktemp("bar") / "m", shape, device="cpu")


def test_transformers_load_bar_follows_our_rule(tiny, capfd):
    import ipykernel  # noqa: F401 - a process that imported ipykernel (a run that executed a notebook) is no notebook
    from transformers.utils import logging as hf_logging

    from exllama_integrations import ExLlamaRuntime

    before = hf_logging.is_progress_bar_enabled()
    ExLlamaRuntime(tiny, "transformers").close()  # stderr is no terminal here: no bar
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled() == before  # the user's switch is left as it was
    ExLlamaRuntime(tiny, "transformers", progressbar=True).close()
    assert "Loading weights" in capfd.readouterr().err
