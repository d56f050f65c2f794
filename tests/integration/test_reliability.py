"""One runtime, many callers: concurrency, cancellation, memory, bad input, untrusted model files."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from exllama_integrations import ExLlamaRuntime, InvalidModelError, InvalidSettingsError
from exllama_integrations.model.tokenizer import ChatTemplateError

from helpers import run_isolated

PROMPTS = [
    "The capital of France is",
    "One, two, three,",
    "The sky is",
    "Hello, my name is",
    "Water boils at",
    "The opposite of hot is",
    "Cats and",
    "In 1492,",
]
KW = {"temperature": 0, "max_new_tokens": 6}


def test_64_concurrent_callers_get_their_own_answers(tiny_runtime: ExLlamaRuntime, tiny_dir, demo_dir):
    """32 threads and 32 asyncio tasks, mixing invoke/stream/batch through LangChain and LlamaIndex (on the tiny
    random model: the answers are only compared, so a trained model's are not needed; they all differ)."""
    from exllama_integrations.langchain import ChatExLlama, ExLlamaLLM
    from exllama_integrations.llama_index import ExLlamaLLM as LIExLlamaLLM

    lc = ExLlamaLLM(model_dir=str(tiny_dir), backend="transformers", **{"temperature": 0, "max_new_tokens": 6})
    li = LIExLlamaLLM(model_dir=str(tiny_dir), backend="transformers", temperature=0, max_new_tokens=6)
    chat = ChatExLlama(model_dir=str(tiny_dir), backend="transformers", temperature=0, max_tokens=6)
    assert lc.exllama_runtime is li.exllama_runtime is chat.exllama_runtime is tiny_runtime
    expected = {p: tiny_runtime.generate(p, **KW).text for p in PROMPTS}
    assert len(set(expected.values())) == len(PROMPTS)  # an answer given to the wrong caller would show

    def thread_call(i: int) -> tuple[str, str]:
        p = PROMPTS[i % len(PROMPTS)]
        kind = i % 4
        if kind == 0:
            return p, lc.invoke(p)
        if kind == 1:
            return p, "".join(lc.stream(p))
        if kind == 2:
            return p, lc.batch([p, p])[1]
        return p, li.complete(p).text

    async def task_call(i: int) -> tuple[str, str]:
        p = PROMPTS[i % len(PROMPTS)]
        if i % 3 == 0:
            return p, await lc.ainvoke(p)
        if i % 3 == 1:
            return p, "".join([c async for c in lc.astream(p)])
        return p, (await li.acomplete(p)).text

    async def main() -> list[tuple[str, str]]:
        loop = asyncio.get_running_loop()
        pool = ThreadPoolExecutor(32)
        threaded = [loop.run_in_executor(pool, thread_call, i) for i in range(32)]
        tasks = [task_call(i) for i in range(32)]
        out = await asyncio.wait_for(asyncio.gather(*threaded, *tasks), timeout=600)
        pool.shutdown()
        return out

    results = asyncio.run(main())
    assert len(results) == 64
    for prompt, text in results:
        assert text == expected[prompt]
    assert chat.invoke("What is the capital of France?").content  # still serving after the storm
    demo = ChatExLlama(model_dir=str(demo_dir), backend="transformers", temperature=0, max_tokens=6)
    assert "Paris" in demo.invoke("What is the capital of France?").content


def test_break_close_and_keyboard_interrupt_free_the_runtime(demo_runtime: ExLlamaRuntime):
    for how in ("break", "close", "interrupt"):
        stream = demo_runtime.stream("Tell me a long story.", max_new_tokens=400, ignore_eos=True)
        if how == "break":
            for _ in stream:
                break
            stream.close()
        elif how == "close":
            next(stream)
            stream.close()
        else:
            with pytest.raises(KeyboardInterrupt):
                with stream:
                    for n, _ in enumerate(stream):
                        if n == 2:
                            raise KeyboardInterrupt  # what a notebook's stop button does mid-loop
        # the lock is free at once: another caller is served right away
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(demo_runtime.generate, PROMPTS[0], **KW)
            assert fut.result(timeout=30).text, f"runtime still busy after {how}"


async def test_cancelled_task_stops_its_worker_thread(demo_runtime: ExLlamaRuntime):
    async def consume():
        async for _ in demo_runtime.astream("Tell me a long story.", max_new_tokens=400, ignore_eos=True):
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert demo_runtime.active_requests == 0, "the cancelled caller's request is still decoding"
    assert (await demo_runtime.agenerate(PROMPTS[0], **KW)).text


def test_load_and_close_twenty_times_does_not_grow_memory(tiny_dir):
    """In a fresh interpreter with one malloc arena: per-thread arenas make RSS jump by tens of MB from cycle to
    cycle, which hides a leak or fakes one; with one arena the reading is exact, so the bound can be tight. On the
    tiny random model (13 MB of weights, the demo model's tokenizer): a runtime that kept its model after close
    still grows RSS by 13 MB a cycle, over the 1 MB bound, at a twentieth of the demo model's load time."""
    out = run_isolated(
        f"""
import ctypes, gc, json, os
from exllama_integrations import ExLlamaRuntime
libc = ctypes.CDLL("libc.so.6")
def rss_mb():
    gc.collect()
    libc.malloc_trim(0)  # hand freed heap back to the OS, so RSS shows what is still held
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
sizes = []
for _ in range(20):
    rt = ExLlamaRuntime({str(tiny_dir)!r}, "transformers")
    rt.generate("The capital of France is", max_new_tokens=2)
    rt.close()
    del rt
    sizes.append(rss_mb())
print(json.dumps(sizes))
""",
        timeout=600,
        env={"MALLOC_ARENA_MAX": "1"},
    )
    import statistics

    tail = out[4:]
    slope = statistics.linear_regression(range(len(tail)), tail).slope
    print(f"RSS after cycles 5/10/20: {out[4]:.0f}/{out[9]:.0f}/{out[19]:.0f} MB, slope {slope:.2f} MB/cycle")
    assert slope < 1, f"resident memory grows {slope:.1f} MB per load/close cycle"
    assert out[19] - out[4] < 20, f"resident memory grew {out[19] - out[4]:.0f} MB over 15 cycles"


def test_failed_load_leaves_nothing_loaded(demo_dir, tmp_path: Path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(demo_dir, bad)
    st = bad / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 3])
    before = ExLlamaRuntime.loaded()
    with pytest.raises(InvalidModelError, match="truncated"):
        ExLlamaRuntime.shared(bad, backend="transformers")
    assert ExLlamaRuntime.loaded() == before


@pytest.mark.parametrize(
    "payload",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ raise_exception.__globals__['os'].system('echo pwned') }}",
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
        "{% set x = messages.append({'role': 'evil'}) %}{{ messages }}",
        "{% include '/etc/passwd' %}",
    ],
)
def test_hostile_chat_templates_are_stopped(demo_dir, tmp_path: Path, payload: str):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(demo_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = payload
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    from exllama_integrations.model.tokenizer import NativeTokenizer

    tok = NativeTokenizer.from_model_dir(str(d))
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stop": "x", "stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"top_k": 1.5}, "top_k"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"seed": "abc"}, "seed"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
    ],
)
def test_more_bad_settings_keep_the_runtime_usable(demo_runtime: ExLlamaRuntime, kwargs, match):
    with pytest.raises(InvalidSettingsError, match=match):
        demo_runtime.generate(PROMPTS[0], **kwargs)
    assert demo_runtime.generate(PROMPTS[0], **KW).text


def test_bad_constraints_are_typed(demo_runtime: ExLlamaRuntime):
    from exllama_integrations import ConstraintError
    from exllama_integrations.model.grammar import TokenConstraint

    tok = demo_runtime.tokenizer
    with pytest.raises(ConstraintError, match="not valid JSON"):
        TokenConstraint.json_schema(tok, "{nope")
    with pytest.raises(ConstraintError, match="regex"):
        TokenConstraint.regex(tok, "a(b")
    with pytest.raises(ConstraintError, match="Lark"):
        TokenConstraint.lark(tok, "start: undefined_rule")
    from exllama_integrations.langchain import ChatExLlama

    chat = ChatExLlama(runtime=demo_runtime, temperature=0)
    bad_tool = {
        "type": "function",
        "function": {"name": "t", "parameters": {"type": "object", "properties": {"x": {"type": "no-such-type"}}}},
    }
    with pytest.raises(ConstraintError):
        chat.bind_tools([bad_tool], tool_choice="t").invoke("hi")
    assert demo_runtime.generate(PROMPTS[0], **KW).text
