"""LangChain ExLlamaLLM end to end on the CPU reference backend.

What needs a trained model's answers (it names Paris) runs on the real demo model (``where``); the plumbing (callbacks,
streaming, usage, stop strings, batching, seeds, the event loop) on SmolLM2's tokenizer over a tiny random model
(``llm``, ``tiny_where``), ~20x faster.
"""

import asyncio
import subprocess
import sys

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import PromptTemplate

from exllama_integrations import ExLlamaRuntime, InvalidSettingsError
from exllama_integrations.langchain import ExLlamaLLM

from fixture_models import TINY_SMOLLM2
from helpers import loop_ticks

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def llm(tiny_where) -> ExLlamaLLM:
    return ExLlamaLLM(**tiny_where, temperature=0, max_new_tokens=24)


class Tokens(BaseCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.chunks: list[object] = []

    def on_llm_new_token(self, token: str, *, chunk=None, **kwargs) -> None:
        self.tokens.append(token)
        self.chunks.append(chunk)


def test_invoke_in_a_chain(where):
    llm = ExLlamaLLM(**where, temperature=0, max_new_tokens=8)  # Paris is the first word
    chain = PromptTemplate.from_template("{subject} is") | llm | StrOutputParser()
    assert "Paris" in chain.invoke({"subject": "The capital of France"})


def test_stream_concatenates_to_invoke_and_callbacks_see_every_token(llm: ExLlamaLLM):
    cb = Tokens()
    chunks = list(llm.stream(PROMPT, config={"callbacks": [cb]}))
    assert len([c for c in chunks if c]) > 2
    assert "".join(chunks) == llm.invoke(PROMPT)
    assert cb.tokens == [c for c in chunks if c]
    assert all(ch is not None and ch.text == t for ch, t in zip(cb.chunks, cb.tokens))


class OnlyEnds(BaseCallbackHandler):
    """A handler that does not listen for tokens (LangChain's StdOutCallbackHandler is one)."""

    def __init__(self) -> None:
        self.ends = 0

    def on_llm_end(self, response, **kwargs) -> None:
        self.ends += 1


def test_invoke_streams_to_a_handler_that_listens_and_reads_whole_for_one_that_does_not(llm: ExLlamaLLM):
    listening, quiet = Tokens(), OnlyEnds()
    text = llm.invoke(PROMPT, config={"callbacks": [listening]})
    assert len(listening.tokens) > 2 and "".join(listening.tokens) == text
    assert llm.invoke(PROMPT, config={"callbacks": [quiet]}) == text and quiet.ends == 1
    res = llm.generate([PROMPT], callbacks=[quiet])
    assert res.generations[0][0].text == text and res.generations[0][0].generation_info["time_to_first_token"] > 0


async def test_ainvoke_streams_to_a_listening_handler_and_gathers_whole_ones_at_once(llm: ExLlamaLLM):
    listening = Tokens()
    text = await llm.ainvoke(PROMPT, config={"callbacks": [listening]})
    assert len(listening.tokens) > 2 and "".join(listening.tokens) == text
    async with loop_ticks() as watch:
        many = await asyncio.gather(*(llm.ainvoke(PROMPT) for _ in range(4)))
    assert many == [text] * 4
    watch.assert_free()


def test_generate_reports_usage_and_finish_reason(llm: ExLlamaLLM):
    res = llm.generate([PROMPT])
    info = res.generations[0][0].generation_info
    assert info["finish_reason"] in ("stop", "length") and info["native_finish_reason"] in ("eos", "length")
    usage = info["usage"]
    assert usage["prompt_tokens"] == len(llm.exllama_runtime.encode(PROMPT, add_special_tokens=True))
    assert res.llm_output["token_usage"]["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert res.llm_output["model_name"] == TINY_SMOLLM2  # the model directory's name


def test_stop_from_call_and_field_are_merged(tiny_where, llm: ExLlamaLLM):
    full = llm.invoke(PROMPT)
    early, late = full.split()[2], full.split()[4]  # two words inside the reply (24 tokens of words)
    assert late not in llm.invoke(PROMPT, stop=[late]) and full.startswith(llm.invoke(PROMPT, stop=[late]))
    with_field = ExLlamaLLM(**tiny_where, temperature=0, max_new_tokens=24, stop=[early])
    assert with_field.exllama_runtime is llm.exllama_runtime  # shared, loaded once
    assert with_field.invoke(PROMPT) == llm.invoke(PROMPT, stop=[early])
    out = with_field.invoke(PROMPT, stop=[late])  # the field's stop comes first: a call's stop must not replace it
    assert late not in out and early not in out and full.startswith(out)


def test_max_new_tokens_from_field_and_call(llm: ExLlamaLLM):
    res = llm.generate(["Count: 1, 2, 3,"], max_new_tokens=4, ignore_eos=True)
    assert res.generations[0][0].generation_info["usage"]["completion_tokens"] == 4
    res = llm.generate(["Count: 1, 2, 3,"], max_tokens=3, ignore_eos=True)  # LangChain's standard name
    assert res.generations[0][0].generation_info["usage"]["completion_tokens"] == 3


def test_token_counting_uses_the_native_tokenizer(llm: ExLlamaLLM):
    text = "Tokenizers count 12345 différently 🦙"
    ids = llm.exllama_runtime.tokenizer.encode(text, add_special_tokens=False)
    assert llm.get_token_ids(text) == ids
    assert llm.get_num_tokens(text) == len(ids)


def test_batch_of_four(llm: ExLlamaLLM):
    prompts = [PROMPT, "One, two,", "The sky is", "Hello, my name is"]
    assert llm.batch(prompts) == [llm.invoke(p) for p in prompts]


def test_seed_reproduces(tiny_where):
    s = ExLlamaLLM(**tiny_where, temperature=1.0, seed=7, max_new_tokens=16)
    assert s.invoke("Once upon a time") == s.invoke("Once upon a time")


async def test_astream_keeps_loop_free_and_matches(llm: ExLlamaLLM):
    async with loop_ticks() as ticks:
        text = "".join([c async for c in llm.astream(PROMPT)])
    assert text == llm.invoke(PROMPT)
    ticks.assert_free()
    assert await llm.ainvoke(PROMPT) == text
    assert await llm.abatch([PROMPT, "The sky is"]) == [text, llm.invoke("The sky is")]


def test_invalid_sampling_values_fail_at_construction_and_call(tiny_where, llm: ExLlamaLLM):
    with pytest.raises(InvalidSettingsError, match="temperature"):
        ExLlamaLLM(**tiny_where, temperature=-1)
    with pytest.raises(InvalidSettingsError, match="top_p"):
        llm.invoke(PROMPT, top_p=2.0)
    with pytest.raises(InvalidSettingsError, match="stop"):
        llm.invoke(PROMPT, stop=[1, 2])


def test_needs_a_model(demo_dir):
    with pytest.raises(InvalidSettingsError, match="model_dir"):
        ExLlamaLLM()
    rt = ExLlamaRuntime.shared(demo_dir, backend="transformers")
    assert ExLlamaLLM(runtime=rt).exllama_runtime is rt


def test_private_runtime(tiny_dir, llm: ExLlamaLLM):
    p = ExLlamaLLM(model_dir=str(tiny_dir), backend="transformers", shared_runtime=False)
    assert p.exllama_runtime is not llm.exllama_runtime
    p.exllama_runtime.close()


def test_from_model_id_takes_huggingfacepipeline_arguments(tiny_dir, llm: ExLlamaLLM):
    demo_dir = tiny_dir
    hf_style = ExLlamaLLM.from_model_id(
        model_id=str(demo_dir),
        task="text-generation",
        device=-1,
        pipeline_kwargs={"max_new_tokens": 24, "do_sample": False, "repetition_penalty": 1.0},
    )
    assert hf_style.temperature == 0.0 and hf_style.exllama_runtime.backend_name == "transformers"
    assert hf_style.invoke(PROMPT) == llm.invoke(PROMPT)
    full = ExLlamaLLM.from_model_id(
        str(demo_dir), device=-1, pipeline_kwargs={"max_new_tokens": 8, "return_full_text": True}
    )
    assert full.invoke(PROMPT).startswith(PROMPT)
    with pytest.raises(InvalidSettingsError, match="text-generation"):
        ExLlamaLLM.from_model_id(str(demo_dir), task="summarization")
    with pytest.raises(InvalidSettingsError, match="trust_remote_code"):
        ExLlamaLLM.from_model_id(str(demo_dir), model_kwargs={"trust_remote_code": True})


def test_use_chat_template_answers_like_an_assistant(where):
    chat = ExLlamaLLM(**where, temperature=0, max_new_tokens=30, use_chat_template=True)
    assert "Paris" in chat.invoke("What is the capital of France?")


def test_identifying_params(llm: ExLlamaLLM):
    p = llm._identifying_params
    assert p["model_name"] == TINY_SMOLLM2 and p["backend"] == "transformers" and p["temperature"] == 0


def test_cli_demo_answers_paris(demo_dir):
    out = subprocess.run(
        [sys.executable, "-m", "exllama_integrations", "demo"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "backend=transformers" in out.stderr and "tokens/s=" in out.stderr


def test_cli_generate_and_typed_error(demo_dir, tmp_path):
    ok = subprocess.run(
        [
            sys.executable,
            "-m",
            "exllama_integrations",
            "generate",
            "--model-dir",
            str(demo_dir),
            "--max-new-tokens",
            "6",
            "--stop",
            ".",
            PROMPT,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ok.returncode == 0 and "Paris" in ok.stdout and "." not in ok.stdout.strip()
    bad = subprocess.run(
        [sys.executable, "-m", "exllama_integrations", "generate", "--model-dir", str(tmp_path / "missing"), "hi"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "ModelNotFoundError" in bad.stderr and "does not exist" in bad.stderr
