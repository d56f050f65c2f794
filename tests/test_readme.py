"""The README's Python examples run as written on CPU, and each one's claims are asserted.

Blocks run in order in one namespace; every block must have a check below (a new example without
one fails), keyed by a line that only that block has.
"""

import re
from pathlib import Path

import pytest

README = (Path(__file__).parents[1] / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


def _model_dir(ns, out):
    assert Path(ns["model_dir"], "config.json").is_file()


def _llm(ns, out):
    assert "Paris" in out
    text = "How many tokens is this?"
    assert ns["n"] == len(ns["llm"].exllama_runtime.encode(text)) > 0


def _chat(ns, out):
    msg, chat = ns["msg"], ns["chat"]
    assert "Paris" in msg.content and msg.response_metadata["finish_reason"] == "stop"
    prompt_tokens = chat.get_num_tokens_from_messages(
        [("system", "Be brief."), ("human", "What is the capital of France?")]
    )
    assert msg.usage_metadata["input_tokens"] == prompt_tokens
    assert "name='Paris'" in out
    call = ns["call"].tool_calls[0]
    assert call["name"] == "add" and call["args"] == {"a": 2, "b": 3} and call["id"].startswith("call_")


def _from_model_id(ns, out):
    assert "Paris" in out and ns["llm"].temperature == 0.0


def _llama_index(ns, out):
    counter, answer = ns["counter"], ns["answer"]
    assert "Paris" in str(answer)
    assert f"{counter.prompt_llm_token_count} {counter.completion_llm_token_count}" in out
    assert counter.prompt_llm_token_count > 20  # the rendered prompt, counted by the model's tokenizer
    n = len(ns["li_llm"].tokenizer_fn(str(answer)))
    assert counter.completion_llm_token_count in (n, n + 1)  # + the end-of-turn token when it ended there


def _runtime(ns, out):
    r, rt = ns["r"], ns["rt"]
    assert "Paris" in r.text and r.finish_reason in ("eos", "length")
    assert r.usage.prompt_tokens == len(rt.encode("The capital of France is", add_special_tokens=True))
    assert r.timings.time_to_first_token > 0
    whole = rt.generate("One, two,", temperature=0, max_tokens=6).text
    assert out.rstrip("\n").endswith(whole)  # the request value gives what the conveniences give


def _reasoning(ns, out):
    reply, city, thinker = ns["reply"], ns["city"], ns["thinker"]
    thought = reply.additional_kwargs["reasoning_content"]
    assert thought and thought in out and "<think>" not in reply.content and "</think>" not in reply.content
    assert 6 <= reply.usage_metadata["output_token_details"]["reasoning"] <= 9  # the budget, then "</think>"
    assert f"{reply.usage_metadata['output_token_details']}" in out
    assert isinstance(city, ns["City"]) and city.name
    assert thinker.profile["reasoning_output"] is True
    assert thinker.profile["max_input_tokens"] == thinker.exllama_runtime.model_info().context_length


def _agent(ns, out):
    steps = ns["steps"]
    calls = [c for m in steps for c in getattr(m, "tool_calls", [])]
    assert calls and calls[0]["name"] == "add" and calls[0]["args"] == {"a": 2, "b": 3}
    assert type(steps[-2]).__name__ == "ToolMessage" and steps[-2].text == "5"
    assert steps[-1].text.strip() and steps[-1].text in out and "tool_response>" not in steps[-1].text


CHECKS = {
    "model_dir = str(demo_model_dir())": _model_dir,
    "chain = PromptTemplate": _llm,
    "chat = ChatExLlama(": _chat,
    "ExLlamaLLM.from_model_id(": _from_model_id,
    "TokenCountingHandler(": _llama_index,
    "rt = ExLlamaRuntime.shared(": _runtime,
    "thinker = ChatExLlama(": _reasoning,
    "agent = create_agent(": _agent,
}


def _check_for(block: str):
    found = [check for key, check in CHECKS.items() if key in block]
    assert len(found) == 1, f"README block without exactly one check:\n{block}"
    return found[0]


def test_every_readme_example_has_a_check():
    assert len(BLOCKS) >= 6
    for block in BLOCKS:
        _check_for(block)


def test_readme_python_blocks_run_in_order_and_do_what_they_say(demo_dir, capsys):
    namespace: dict = {}
    for i, block in enumerate(BLOCKS):
        try:
            exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)
        except Exception as e:  # pragma: no cover - the message is what matters
            raise AssertionError(f"README python block {i + 1} failed: {type(e).__name__}: {e}\n{block}") from e
        out = capsys.readouterr().out
        try:
            _check_for(block)(namespace, out)
        except AssertionError as e:
            pytest.fail(f"README python block {i + 1} does not do what it says: {e}\noutput: {out!r}")
