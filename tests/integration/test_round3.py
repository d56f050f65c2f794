"""Hardening, round 3: each finding of the review at b073b3e, as a test that failed before its fix.

Hostile cases run in a subprocess with a time and memory cap (``run_isolated``), so a regression fails
instead of hanging or killing the run.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import pytest
from servers import ThreadServer

from exllama_integrations import ChatTemplateError, ExLlamaRuntime, InvalidSettingsError

from helpers import run_isolated

# ------------------------------------------------------------------ 1. the template sandbox, as a class

HOSTILE = [
    "{{ lipsum(200000) }}",
    "{{ [1, 2, 3] | slice(100000000) | list }}",
    "{{ [1, 2, 3] | batch(100000000, 'x') | list }}",
    "{{ '%*s' % (100000000000, 'x') }}",
    "{{ '%-*.*f' % (10, 100000000000, 1.5) }}",
    "{{ '%*s' | format(100000000000, 'x') }}",
    "{{ '{:>{}}'.format('x', 100000000000) }}",
    "{{ '{0:{1}}'.format('x', '>100000000000') }}",
    "{{ '{:0{w}d}'.format(1, w=100000000000) }}",
    "{{ ('%0' ~ 100000000000 ~ 'd') % 1 }}",
    "{{ 'x' | center(100000000000) }}",
]


def test_hostile_templates_are_refused_fast_in_a_capped_process():
    code = f"""
import json, time
from exllama_integrations.model.template import ChatTemplate
from exllama_integrations.errors import ChatTemplateError
out = []
for source in {HOSTILE!r}:
    t0 = time.perf_counter()
    try:
        ChatTemplate(source).render(messages=[])
        out.append([source, "rendered", time.perf_counter() - t0])
    except ChatTemplateError as e:
        out.append([source, "refused", time.perf_counter() - t0])
print(json.dumps(out))
"""
    results = run_isolated(code, timeout=120, memory_mb=3000)
    for source, what, seconds in results:
        assert what == "refused", source
        assert seconds < 2.0, f"{source} took {seconds:.1f}s to refuse"


def test_sandbox_widths_hold_for_any_size_given_any_way():
    """Hypothesis: a size given as a literal, an argument, a keyword or a nested field is either small enough to
    render or refused, and never takes long."""
    code = r"""
import json, time
from hypothesis import given, settings, strategies as st
from exllama_integrations.model.template import ChatTemplate, MAX_STRING
from exllama_integrations.errors import ChatTemplateError
FORMS = [
    "{{{{ '%*s' % ({n}, 'x') }}}}",
    "{{{{ '{{:>{{}}}}'.format('x', {n}) }}}}",
    "{{{{ '{{:0{{w}}d}}'.format(1, w={n}) }}}}",
    "{{{{ '%*s'|format({n}, 'x') }}}}",
    "{{{{ 'x'.rjust({n}) }}}}",
    "{{{{ 'ab' * {n} }}}}",
    "{{{{ [0]|batch({n}, 0)|list|length }}}}",
    "{{{{ [0, 1]|slice({n})|list|length }}}}",
    "{{{{ ('%0' ~ {n} ~ 'd') % 1 }}}}",
]
seen = {"rendered": 0, "refused": 0}
@settings(max_examples=150, deadline=None)
@given(st.sampled_from(FORMS), st.one_of(st.integers(0, 5000), st.integers(0, 10**13)))
def check(form, n):
    t0 = time.perf_counter()
    try:
        out = ChatTemplate(form.format(n=n)).render(messages=[])
        assert len(out) <= 2 * MAX_STRING + 64
        seen["rendered"] += 1
    except ChatTemplateError as e:
        seen["refused"] += 1
        # a size past the limit is refused before anything is built, not caught by the output backstop afterwards
        assert n <= MAX_STRING or not any(w in str(e) for w in ("rendered more than", "MemoryError")), (form, n, str(e))
    assert time.perf_counter() - t0 < 3.0, (form, n)
check()
print(json.dumps(seen))
"""
    seen = run_isolated(code, timeout=300, memory_mb=3000)
    assert seen["rendered"] > 0 and seen["refused"] > 0


def test_templates_people_ship_still_render():
    from arch_models import GEMMA3, LLAMA3, QWEN3

    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    for source in (QWEN3, LLAMA3, GEMMA3):
        out = ChatTemplate_render(source, tools)
        assert "hello" in out


def ChatTemplate_render(source: str, tools: list) -> str:  # noqa: N802 - reads as the class it uses
    from exllama_integrations.model.template import ChatTemplate

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    return ChatTemplate(source).render(messages=messages, tools=tools, add_generation_prompt=True)


# ------------------------------------------------------------------ 3, 4, 6, 9, 19: the server


@pytest.fixture(scope="module")
def capped(demo_runtime):
    from exllama_integrations.serve.state import ServeLimits

    limits = ServeLimits(max_tokens=5, max_body_bytes=2048, body_timeout=1.5)
    server = ThreadServer(demo_runtime, api_key="k", limits=limits)
    yield server
    server.stop()


KEY = {"Authorization": "Bearer k"}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_max_tokens_caps_the_resolved_settings_not_the_field(capped, path):
    body = {"prompt": "Count: 1, 2, 3,", "ignore_eos": True, "temperature": 0}
    if path.endswith("chat/completions"):
        body = {"messages": [{"role": "user", "content": "Count to ten."}], "ignore_eos": True}
    r = httpx.post(capped.url + path, json=body, headers=KEY, timeout=60)  # max_tokens left out
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 5
    r = httpx.post(capped.url + path, json={**body, "max_tokens": 6}, headers=KEY, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "max_tokens_too_large"


def test_the_api_docs_need_the_key_and_health_tells_no_pid(capped):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(capped.url + path, timeout=10).status_code == 401
        assert httpx.get(capped.url + path, headers=KEY, timeout=10).status_code == 200
    health = httpx.get(capped.url + "/health", timeout=10).json()
    assert "pid" not in health and health["status"] == "ok"


def test_unknown_routes_wrong_methods_and_chunked_bodies_answer_openai_errors(capped):
    r = httpx.get(capped.url + "/v1/nothing", headers=KEY, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(capped.url + "/v1/completions", headers=KEY, timeout=10)
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"

    def chunks():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 1024
        yield b'"}'

    r = httpx.post(capped.url + "/v1/completions", content=chunks(), headers=KEY, timeout=10)  # no Content-Length
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    bad = b'{"prompt": "\xff\xfe", "max_tokens": 2}'
    r = httpx.post(capped.url + "/v1/completions", content=bad, headers={**KEY, "content-type": "application/json"})
    assert r.status_code in (400, 422) and "error" in r.json()
    deep = b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    r = httpx.post(
        capped.url + "/v1/completions", content=deep[:2000], headers={**KEY, "content-type": "application/json"}
    )
    assert r.status_code in (400, 422) and "error" in r.json()


def test_a_client_that_trickles_its_body_gets_408_and_its_slot_back(capped):
    body = b'{"prompt": "Hi", "max_tokens": 2}'
    with socket.create_connection(("127.0.0.1", capped.port), timeout=10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer k\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
        )
        t0 = time.perf_counter()
        answer = b""
        for byte in body:  # one byte a second: slower than the 1.5 s the whole body may take
            try:
                s.sendall(bytes([byte]))
            except OSError:
                break
            s.settimeout(1.0)
            try:
                answer += s.recv(4096)
            except TimeoutError:
                continue
            if answer:
                break
        waited = time.perf_counter() - t0
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer
    assert waited < 5  # not the 30 s it would have taken to trickle the body
    assert capped.app.state.serve.pending == 0


def test_the_log_line_cannot_be_forged_through_the_path(capped, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="exllama_integrations.serve")
    httpx.post(capped.url + "/v1/completions%0Aid=forged POST /x 200", json={}, headers=KEY, timeout=10)
    lines = [r.getMessage() for r in caplog.records if "POST" in r.getMessage()]
    assert lines and all("\n" not in line for line in lines)


def test_a_non_streamed_request_whose_client_leaves_is_cancelled(demo_runtime):
    server = ThreadServer(demo_runtime)
    try:
        body = json.dumps({"prompt": "Count:", "max_tokens": 2000, "ignore_eos": True}).encode()
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            head = (
                "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n\r\n"
            )
            s.sendall(head.encode() + body)
            t0 = time.perf_counter()
            while demo_runtime.active_requests == 0 and time.perf_counter() - t0 < 10:
                time.sleep(0.02)
            assert demo_runtime.active_requests == 1
        t0 = time.perf_counter()  # the client is gone: its 2,000 tokens are not generated
        while demo_runtime.active_requests and time.perf_counter() - t0 < 10:
            time.sleep(0.05)
        assert demo_runtime.active_requests == 0 and time.perf_counter() - t0 < 10
        assert server.app.state.serve.pending == 0  # its admission slot is back
    finally:
        server.stop()


def test_the_model_field_may_be_left_out_and_models_have_a_creation_time(capped):
    r = httpx.post(capped.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=KEY, timeout=60)
    assert r.status_code == 200
    card = httpx.get(capped.url + "/v1/models", headers=KEY, timeout=10).json()["data"][0]
    assert card["created"] > 1_700_000_000 and card["max_model_len"] == card["context_length"] > 0


def test_the_cli_says_its_version_and_its_defaults():
    import subprocess
    import sys

    run = [sys.executable, "-m", "exllama_integrations"]
    out = subprocess.run([*run, "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("exllama-integrations ")
    help_text = subprocess.run([*run, "serve", "--help"], capture_output=True, text=True, timeout=60).stdout
    assert "(default: 8000)" in help_text and "--max-model-len" in help_text and "--chat-template" in help_text
    assert "(default: None)" not in help_text
    assert subprocess.run([*run, "serve", "-v", "--help"], capture_output=True, timeout=60).returncode == 0


# ------------------------------------------------------------------ 8, 10, 11, 18: arguments and output


def test_template_kwargs_naming_the_renderers_own_arguments_are_refused_typed(demo_dir, demo_runtime):
    from exllama_integrations.langchain import ChatExLlama

    chat = ChatExLlama(model_dir=str(demo_dir), backend="transformers", max_tokens=2)
    with pytest.raises(InvalidSettingsError, match="chat_template_kwargs may not set messages"):
        chat.invoke("hi", chat_template_kwargs={"messages": []})
    server = ThreadServer(demo_runtime)
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tools": []}}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    finally:
        server.stop()


def test_a_template_path_with_a_brace_is_read_as_a_file(demo_dir, tmp_path: Path):
    from exllama_integrations.langchain import ChatExLlama

    folder = tmp_path / "my{templates}"
    folder.mkdir()
    path = folder / "chat.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] ")
    chat = ChatExLlama(model_dir=str(demo_dir), backend="transformers", chat_template=str(path))
    assert chat.chat_template == path.read_text()
    with pytest.raises(InvalidSettingsError, match="looks like a path"):
        ChatExLlama(model_dir=str(demo_dir), backend="transformers", chat_template=str(tmp_path / "missing.jinja"))


def test_structured_output_keeps_the_schemas_order(demo_dir):
    from pydantic import BaseModel

    from exllama_integrations.langchain import ChatExLlama

    class Verdict(BaseModel):
        reasoning: str
        answer: bool

    chat = ChatExLlama(model_dir=str(demo_dir), backend="transformers", temperature=0, max_tokens=80)
    out = chat.with_structured_output(Verdict, include_raw=True).invoke("Is Paris in France? Reason, then answer.")
    assert str(out["raw"].content).lstrip().startswith('{"reasoning"')  # reason first, then answer


def test_structured_output_streams_only_complete_objects(demo_dir):
    from pydantic import BaseModel

    from exllama_integrations.langchain import ChatExLlama

    class City(BaseModel):
        name: str
        country: str

    chat = ChatExLlama(model_dir=str(demo_dir), backend="transformers", temperature=0, max_tokens=60)
    streamed = list(chat.with_structured_output(City).stream("Tell me about Paris."))
    assert len(streamed) == 1 and streamed[0].name and streamed[0].country  # never City(name='', ...)


def test_a_langchain_agent_whose_first_step_is_forced_answers_after_its_tool(demo_dir):
    """docs/tool-calls.md's ``create_agent`` example: a 135M model does not pick a tool by itself, so a middleware sets
    ``tool_choice`` for the first model call; the tool runs and the agent's last message is an answer in words."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import wrap_model_call
    from langchain_core.messages import AIMessage, ToolMessage
    from langchain_core.tools import tool

    from exllama_integrations.langchain import ChatExLlama

    calls = []

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    @wrap_model_call
    def call_a_tool_first(request, handler):
        if not any(isinstance(m, ToolMessage) for m in request.messages):
            request = request.override(tool_choice="add")
        return handler(request)

    chat = ChatExLlama(model_dir=str(demo_dir), backend="transformers", temperature=0, max_tokens=40)
    agent = create_agent(chat, tools=[add], middleware=[call_a_tool_first])
    out = agent.invoke({"messages": [("user", "What is 2 + 3? Use the add tool.")]})
    last = out["messages"][-1]
    assert calls == [(2, 3)] and isinstance(last, AIMessage) and not last.tool_calls
    assert last.text.strip() and "tool_response>" not in last.text


def test_create_agent_with_a_response_format_uses_the_grammar_not_a_tool(demo_dir):
    """``create_agent(model=ChatExLlama(...), response_format=Schema)``: the profile says structured output is
    native, so LangChain's ProviderStrategy sends ``response_format`` and the grammar writes the answer."""
    from langchain.agents import create_agent
    from pydantic import BaseModel

    from exllama_integrations.langchain import ChatExLlama

    class City(BaseModel):
        name: str
        country: str

    chat = ChatExLlama(model_dir=str(demo_dir), backend="transformers", temperature=0, max_tokens=60)
    out = create_agent(chat, tools=[], response_format=City).invoke({"messages": [("user", "Tell me about Paris.")]})
    last = out["messages"][-1]
    assert isinstance(out["structured_response"], City) and out["structured_response"].name
    assert not last.tool_calls and last.response_metadata["constraint_complete"] is True  # not ToolStrategy


def test_names_from_other_tools(demo_dir):
    from exllama_integrations.langchain import ChatExLlama, ExLlamaLLM

    assert ChatExLlama(model=str(demo_dir), backend="transformers").model_dir == str(demo_dir)  # ChatOllama's name
    llm = ExLlamaLLM(model_dir=str(demo_dir), backend="transformers", num_predict=3, temperature=0)
    assert llm.max_new_tokens == 3
    with pytest.raises(InvalidSettingsError, match="num_ctx.*max_seq_len"):
        ExLlamaLLM(model_dir=str(demo_dir), backend="transformers", num_ctx=4096)


def test_the_cpu_backend_takes_a_thread_count(demo_dir):
    import torch

    before = torch.get_num_threads()
    rt = ExLlamaRuntime(demo_dir, "transformers", num_threads=1)
    try:
        assert rt.model_info().details["threads"] == 1 and torch.get_num_threads() == 1
    finally:
        rt.close()
        torch.set_num_threads(before)
    with pytest.raises(InvalidSettingsError, match="num_threads"):
        ExLlamaRuntime(demo_dir, "transformers", num_threads=0)


def test_chat_template_errors_stay_typed(demo_runtime):
    with pytest.raises(ChatTemplateError):
        demo_runtime.chat_prompt([{"role": "user", "content": "x"}], chat_template="{{ lipsum(3) }}")
