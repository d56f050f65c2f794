"""A served model's tool-call format: ``serve --tool-format NAME``, and the checkpoint's own ``response_template``.

``--tool-format`` overrides the format found in the chat template for every chat request, as ``tool_format=`` does
in process (calls forced in that syntax, read back in it, with its call ids); a name that is no format is refused at
start, before any model loads, with the names there are; ``/v1/models`` and ``/v1/exllama/info`` say which format
is in use. A model directory whose tokenizer_config.json declares a ``response_template`` (transformers 5.x) has its
calls read with transformers' parser over it, ahead of the family table, at every door (LangChain in process, the
OpenAI server, LangChain over the server's wire); the model info says so, and ``--tool-format`` still overrides it.
The models are tiny random-weight Hermes-family models (tests/tool_families.py) on the real CPU backend.
"""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import subprocess
import sys
import time

import httpx
import jsonschema
import pytest
from servers import wait_until_up
from tool_families import TOOLS, make_family

from exllama_integrations import ExLlamaRuntime
from exllama_integrations.contract.api import Grammar
from exllama_integrations.errors import InvalidSettingsError

QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def _bounded(schema):
    """The schema with its free strings at most 8 characters (a random-weight model writes a string until cut)."""
    if isinstance(schema, dict):
        out = {k: _bounded(v) for k, v in schema.items()}
        return {**out, "maxLength": 8} if out.get("type") == "string" and "enum" not in out else out
    return [_bounded(v) for v in schema] if isinstance(schema, list) else schema


BOUNDED = _bounded(TOOLS)

# calls written as a Python list inside Hermes' tags: what this checkpoint's own response_template reads, and what the
# Hermes table (JSON inside the tags) cannot
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open_pattern": r"\s*<tool_call>",
            "close": "</tool_call>",
            "repeats": True,
            "content": "python-call-list",
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{arguments}"}},
            "transform_each": True,
        },
        "content": {"content": "text"},
    },
}
REPLY = (
    'Checking.\n<tool_call>[get_weather(city="Paris", unit="celsius"), get_time(timezone="Europe/Paris")]</tool_call>'
)
CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "Europe/Paris"})]


@pytest.fixture(scope="module")
def hermes_dir(tmp_path_factory):
    return make_family("hermes", tmp_path_factory.mktemp("flag") / "hermes")


@pytest.fixture(scope="module")
def template_runtime(tmp_path_factory):
    """A Hermes-family model whose tokenizer_config.json declares its own response_template."""
    path = make_family("hermes", tmp_path_factory.mktemp("flag") / "own-parser", seed=1)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["response_template"] = RESPONSE_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    rt = ExLlamaRuntime(str(path), "transformers")
    yield Scripted(rt, REPLY)
    rt.close()


class Scripted:
    """The runtime with each generation held to ``reply`` by a grammar (after two tokens of thinking)."""

    def __init__(self, inner: ExLlamaRuntime, reply: str) -> None:
        self._inner, self.reply = inner, reply

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def _script(self, request):
        tok, r, prompt = self._inner.tokenizer, request.reasoning, request.prompt
        if r is not None:
            prompt = prompt if r.started else prompt + r.start + "\n"
            r = dataclasses.replace(r, started=True, budget=2)
        marks = ("<tool_call>", "</tool_call>")
        pieces = [p for p in re.split("(" + "|".join(map(re.escape, marks)) + ")", self.reply) if p]
        body = " ".join(f"<[{tok.token_to_id(p)}]>" if p in marks else json.dumps(p) for p in pieces)
        return dataclasses.replace(request, prompt=prompt, reasoning=r, grammar=Grammar.lark(f"start: {body}\n"))

    def open(self, request):
        return self._inner.open(self._script(request))

    def aopen(self, request):
        return self._inner.aopen(self._script(request))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unknown_tool_format_is_refused_at_start_with_the_names(capsys, tmp_path, hermes_dir):
    from exllama_integrations.cli import main
    from exllama_integrations.serve.app import create_app
    from exllama_integrations.serve.ray.ingress import front_over

    t0 = time.perf_counter()
    assert main(["serve", "--model-dir", str(tmp_path / "absent"), "--tool-format", "hermez"]) == 2
    err = capsys.readouterr().err
    assert time.perf_counter() - t0 < 5  # refused before any model is looked for or loaded
    assert "InvalidSettingsError" in err and "'hermez'" in err and "hermes, mistral" in err.replace("_v11", "")
    rt = ExLlamaRuntime(str(hermes_dir), "transformers")
    try:
        with pytest.raises(InvalidSettingsError, match="hermes"):
            create_app(rt, tool_format="hermez")
        with pytest.raises(InvalidSettingsError):
            front_over({"": rt}, {"models": {"": {"tool_format": "hermez"}}}, freeze_gc=False)  # each Ray ingress
        template = "{% for m in messages %}<<{{ m.content }}>>{% endfor %}"
        config = {"models": {"": {"tool_format": "mistral", "chat_template": template}}}
        app = front_over({"": rt}, config, freeze_gc=False)
        assert app.state.serve.tool_format == "mistral" and app.state.serve.info.tool_format == "mistral"
        # serve --ray --chat-template: each ingress replica renders chats with the operator's template
        from fastapi.testclient import TestClient

        with TestClient(app) as client:
            body = {"model": app.state.serve.name, "messages": [{"role": "user", "content": "hi there"}]}
            got = client.post("/tokenize", json=body).json()
        assert rt.decode(got["tokens"]).startswith("<<hi there>>")
    finally:
        rt.close()


def test_serve_tool_format_overrides_the_model_format(hermes_dir):
    """``serve --tool-format mistral`` on a Hermes model (engine process): the info says mistral, a forced call
    is written and read in Mistral's format and gets Mistral's 9-character id (Hermes' would be ``call_...``)."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "exllama_integrations", "serve", str(hermes_dir), "--backend", "transformers"]
        + ["--port", str(port), "--tool-format", "mistral"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(url, 120, proc)
        card = httpx.get(url + "/v1/models").json()["data"][0]
        assert card["tool_format"] == "mistral"
        info = httpx.get(url + "/v1/exllama/info").json()["info"]
        assert info["tool_format"] == "mistral" and info["details"]["tool_format_from"] == "serve --tool-format"
        body = {
            "messages": QUESTION,
            "tools": BOUNDED,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "max_tokens": 120,
            "max_reasoning_tokens": 2,  # a thinking family: two tokens of thought, then the forced call
        }
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        [call] = choice["message"]["tool_calls"]
        assert choice["finish_reason"] == "tool_calls" and call["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(call["function"]["arguments"]), BOUNDED[0]["function"]["parameters"])
        assert re.fullmatch(r"[A-Za-z0-9]{9}", call["id"]), call["id"]  # Mistral's ids: the format in use
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_checkpoints_response_template_reads_its_calls_at_every_door(template_runtime):
    from openai import OpenAI
    from servers import ThreadServer

    from exllama_integrations.langchain import ChatExLlama

    info = template_runtime.model_info()
    assert info.tool_format == "hermes"  # its family's entry still writes calls (forced grammar, history)
    assert info.details["tool_calls_read_with"].startswith("response_template")
    assert info.details["response_template"] == RESPONSE_TEMPLATE

    chat = ChatExLlama(runtime=template_runtime, temperature=0, max_tokens=200).bind_tools(TOOLS)
    msg = chat.invoke(QUESTION)
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == CALLS and not msg.invalid_tool_calls
    assert msg.content == "Checking."

    server = ThreadServer(template_runtime)
    overridden = ThreadServer(template_runtime, tool_format="hermes")  # --tool-format: the table reads instead
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(
            messages=QUESTION, tools=TOOLS, model="own-parser", max_tokens=200, stream=True
        )
        text, calls = [], {}
        for ch in stream:
            for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
                c = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                c["name"] += tc.function.name or ""
                c["arguments"] += tc.function.arguments or ""
            text.append((ch.choices[0].delta.content or "") if ch.choices else "")
        assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == CALLS
        assert "".join(text).strip() == "Checking." and not any("<tool_call" in t for t in text)

        remote = ChatExLlama(base_url=server.url, temperature=0, max_tokens=200).bind_tools(TOOLS)
        msg = remote.invoke(QUESTION)  # the template travels in the model info over the wire
        assert [(c["name"], c["args"]) for c in msg.tool_calls] == CALLS and not msg.invalid_tool_calls

        card = httpx.get(overridden.url + "/v1/exllama/info").json()["info"]
        assert card["tool_format"] == "hermes" and "response_template" not in card["details"]
        r = httpx.post(overridden.url + "/v1/chat/completions", json={"messages": QUESTION, "tools": TOOLS}, timeout=60)
        assert not r.json()["choices"][0]["message"].get("tool_calls")  # Hermes' JSON reading finds no call there
    finally:
        server.stop()
        overridden.stop()
