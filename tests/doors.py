"""One chat call through every door, each answer read back to the same plain shape, for tests of tool replies.

The doors: LangChain (``ChatExLlama``) and LlamaIndex (``ExLlamaLLM``) in process, and the server through the clients
people use on it: the ``openai`` client on chat completions and on the Responses API, the ``anthropic`` client on the
Messages API. Each is asked once whole and once streamed; :class:`Reply` is what came back (the calls that read, the
calls that did not, the text, the finish), and for a stream what a client saw as it came (``pieces``: the text
deltas; ``argument_deltas``: each call's argument deltas in order).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

IN_PROCESS = ("langchain", "llama_index")
SERVER = ("chat", "responses", "messages")
DOORS = (*IN_PROCESS, *SERVER)


@dataclass
class Reply:
    """What a door answered, in one shape."""

    calls: list[tuple[str, Any]] = field(default_factory=list)
    """The calls that read: (name, arguments as an object)."""
    cut: list[tuple[str, str]] = field(default_factory=list)
    """Calls cut short: (name, the arguments' JSON text as far as it got)."""
    invalid: list[str] = field(default_factory=list)
    """What the door kept of calls that did not read (LangChain's args, LlamaIndex's raw)."""
    text: str = ""
    finish: str | None = None
    ids: list[str] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    argument_deltas: dict[int, list[str]] = field(default_factory=dict)


def _openai(url: str) -> Any:
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


def _anthropic(url: str) -> Any:
    import anthropic

    return anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)


def _anthropic_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"name": t["function"]["name"], "input_schema": t["function"].get("parameters") or {}} for t in tools]


def _anthropic_choice(choice: Any) -> Any:
    if choice is None:
        return None
    if choice == "required":
        return {"type": "any"}
    if isinstance(choice, str):
        return {"type": choice} if choice in ("auto", "none") else {"type": "tool", "name": choice}
    return {"type": "tool", "name": choice["function"]["name"]}


def _responses_choice(choice: Any) -> Any:
    if isinstance(choice, str) and choice not in ("auto", "none", "required"):
        return {"type": "function", "name": choice}
    if isinstance(choice, dict):
        return {"type": "function", "name": choice["function"]["name"]}
    return choice


def _chat_choice(choice: Any) -> Any:
    if isinstance(choice, str) and choice not in ("auto", "none", "required"):
        return {"type": "function", "function": {"name": choice}}
    return choice


def ask(
    door: str,
    *,
    runtime: Any = None,
    url: str | None = None,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    tool_choice: Any = None,
    max_tokens: int = 400,
    stream: bool = False,
) -> Reply:
    """``messages`` (OpenAI's shape: user and system turns) with ``tools`` through ``door``, read back."""
    return globals()[f"_{door}"](runtime, url, messages, tools, tool_choice, max_tokens, stream)


def _langchain(runtime, url, messages, tools, choice, max_tokens, stream) -> Reply:
    from exllama_integrations.langchain import ChatExLlama

    chat = ChatExLlama(runtime=runtime, temperature=0, max_tokens=max_tokens).bind_tools(tools, tool_choice=choice)
    msgs = [(m["role"], m["content"]) for m in messages]
    deltas: dict[int, list[str]] = {}
    if stream:
        chunks = list(chat.stream(msgs))
        msg = chunks[0]
        for c in chunks[1:]:
            msg = msg + c
        pieces = [c.content for c in chunks]
        for c in chunks:
            for tc in c.tool_call_chunks:
                deltas.setdefault(tc["index"], []).append(tc["args"] or "")
    else:
        msg, pieces = chat.invoke(msgs), []
    finish = msg.response_metadata.get("finish_reason")  # (a streamed chunk carries no error: the finish says it)
    cut = [(c["name"], c["args"]) for c in msg.invalid_tool_calls] if finish == "length" else []
    return Reply(
        calls=[(c["name"], c["args"]) for c in msg.tool_calls],
        cut=cut,
        invalid=[c["args"] for c in msg.invalid_tool_calls],
        text=msg.content,
        finish=finish,
        ids=[c["id"] for c in msg.tool_calls],
        pieces=pieces,
        argument_deltas=deltas,
    )


def _llama_index(runtime, url, messages, tools, choice, max_tokens, stream) -> Reply:
    from llama_index.core.llms import ChatMessage

    from exllama_integrations.llama_index import ExLlamaLLM

    llm = ExLlamaLLM(runtime=runtime, temperature=0, max_new_tokens=max_tokens)
    msgs = [ChatMessage(role=m["role"], content=m["content"]) for m in messages]
    kwargs = {"tools": tools, "tool_choice": choice}
    if stream:
        responses = list(llm.stream_chat(msgs, **kwargs))
        last, pieces = responses[-1], [r.delta or "" for r in responses]
    else:
        last, pieces = llm.chat(msgs, **kwargs), []
    extra = last.message.additional_kwargs
    calls = llm.get_tool_calls_from_response(last, error_on_no_tool_call=False)
    invalid = extra.get("invalid_tool_calls") or []
    return Reply(
        calls=[(c.tool_name, c.tool_kwargs) for c in calls],
        cut=[(c["name"], c.get("arguments", "")) for c in invalid if "cut off by max_tokens" in (c["error"] or "")],
        invalid=[c["raw"] for c in invalid],
        text=last.message.content or "",
        finish=(last.raw or {}).get("finish_reason"),
        ids=[c.tool_id for c in calls],
        pieces=pieces,
    )


def _chat(runtime, url, messages, tools, choice, max_tokens, stream) -> Reply:
    args = {"model": "m", "messages": messages, "tools": tools, "temperature": 0, "max_tokens": max_tokens}
    if choice is not None:
        args["tool_choice"] = _chat_choice(choice)
    client = _openai(url)
    if not stream:
        c = client.chat.completions.create(**args).choices[0]
        return _chat_reply(c.finish_reason, c.message.content or "", c.message.tool_calls or [], [], {})
    text, calls, deltas, finish = chat_stream_parts(client.chat.completions.create(**args, stream=True))
    listed = [_Fn(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())]
    return _chat_reply(finish, "".join(text), listed, text, deltas)


def chat_stream_parts(stream) -> tuple[list[str], dict[int, dict], dict[int, list[str]], str | None]:
    """A streamed chat completion as a client accumulates it: its text pieces, its calls by index (name, arguments,
    id), each call's arguments deltas, and the finish reason."""
    text, calls, deltas, finish = [], {}, {}, None
    for ch in stream:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        text.append(d.content or "")
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": tc.id})
            c["name"] += tc.function.name or ""
            c["arguments"] += tc.function.arguments or ""
            deltas.setdefault(tc.index, []).append(tc.function.arguments or "")
        finish = ch.choices[0].finish_reason or finish
    return text, calls, deltas, finish


@dataclass
class _Fn:
    id: str
    name: str
    arguments: str

    @property
    def function(self) -> _Fn:
        return self


def _chat_reply(finish, text, calls, pieces, deltas) -> Reply:
    reply = Reply(text=text, finish=finish, pieces=pieces, argument_deltas=deltas)
    for c in calls:
        fn = c.function
        if finish == "length":
            reply.cut.append((fn.name, fn.arguments))
            continue
        reply.calls.append((fn.name, json.loads(fn.arguments)))
        reply.ids.append(c.id)
    return reply


def _responses(runtime, url, messages, tools, choice, max_tokens, stream) -> Reply:
    flat = [{"type": "function", **t["function"]} for t in tools]
    args = {"model": "m", "input": messages, "tools": flat, "temperature": 0, "max_output_tokens": max_tokens}
    if choice is not None:
        args["tool_choice"] = _responses_choice(choice)
    client = _openai(url)
    deltas: dict[int, list[str]] = {}
    pieces: list[str] = []
    if stream:
        response = None
        for e in client.responses.create(**args, stream=True):
            if e.type == "response.output_text.delta":
                pieces.append(e.delta)
            elif e.type == "response.function_call_arguments.delta":
                deltas.setdefault(e.output_index, []).append(e.delta)
            elif e.type in ("response.completed", "response.incomplete"):
                response = e.response
    else:
        response = client.responses.create(**args)
    reply = Reply(text=response.output_text, finish=response.status, pieces=pieces, argument_deltas=deltas)
    for item in response.output:
        if item.type != "function_call":
            continue
        if item.status == "incomplete":
            reply.cut.append((item.name, item.arguments))
        else:
            reply.calls.append((item.name, json.loads(item.arguments)))
            reply.ids.append(item.call_id)
    return reply


def _messages(runtime, url, messages, tools, choice, max_tokens, stream) -> Reply:
    system = "\n".join(m["content"] for m in messages if m["role"] == "system")
    args: dict[str, Any] = {
        "model": "m",
        "messages": [m for m in messages if m["role"] != "system"],
        "tools": _anthropic_tools(tools),
        "max_tokens": max_tokens,
        "extra_body": {"temperature": 0},
    }
    if system:
        args["system"] = system
    if choice is not None:
        args["tool_choice"] = _anthropic_choice(choice)
    client = _anthropic(url)
    deltas: dict[int, list[str]] = {}
    pieces: list[str] = []
    if stream:
        with client.messages.stream(**args) as s:
            for e in s:
                if e.type == "content_block_delta" and e.delta.type == "text_delta":
                    pieces.append(e.delta.text)
                elif e.type == "content_block_delta" and e.delta.type == "input_json_delta":
                    deltas.setdefault(e.index, []).append(e.delta.partial_json)
            message = s.get_final_message()
    else:
        message = client.messages.create(**args)
    reply = Reply(finish=message.stop_reason, pieces=pieces, argument_deltas=deltas)
    for i, block in enumerate(message.content):
        if block.type == "text":
            reply.text += block.text
        elif block.type == "tool_use" and message.stop_reason == "max_tokens":
            reply.cut.append((block.name, "".join(deltas.get(i, [])) if stream else json.dumps(block.input)))
        elif block.type == "tool_use":
            reply.calls.append((block.name, block.input))
            reply.ids.append(block.id)
    return reply


__all__ = ["DOORS", "IN_PROCESS", "SERVER", "Reply", "ask"]
