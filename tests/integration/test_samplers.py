"""OpenAI's sampler settings honoured instead of refused: ``logit_bias``, ``presence_penalty``, ``frequency_penalty``.

The oracle is the formula itself, run by hand on transformers' model: a greedy loop that adds the biases and
subtracts the penalties, counting only the generated tokens (OpenAI's and vLLM's meaning). The runtime, the
server (openai client), RemoteRuntime and LangChain must give its tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from exllama_integrations import ExLlamaRuntime, GenerationSettings, InvalidSettingsError

PROMPT = "Repeat after me: la la la la la la la la la la la la"
NEW = 12


@pytest.fixture(scope="module")
def hf_model(demo_dir: Path):
    import torch
    import transformers

    # float32, as the CPU runtime computes (transformers 5 would load the checkpoint's bf16, whose rounded logits tie)
    return transformers.AutoModelForCausalLM.from_pretrained(str(demo_dir), dtype=torch.float32).eval()


def oracle(model, ids: list[int], presence: float = 0.0, frequency: float = 0.0, bias: dict | None = None) -> list[int]:
    """The greedy loop by hand: the prompt read once, then a token a step over the KV cache (a loop that re-read the
    whole sequence each step gave the same tokens at 2.3x the time)."""
    import inspect

    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # 5.2x renamed
    out: list[int] = []
    with torch.no_grad():
        for _ in range(NEW):
            feed = out[-1:] if out else ids
            logits = model(torch.tensor([feed]), use_cache=True, **{name: cache}).logits[0, -1].float()
            for t, b in (bias or {}).items():
                logits[t] += b
            for t in set(out):
                logits[t] -= presence + frequency * out.count(t)
            out.append(int(logits.argmax()))
    return out


def greedy(**kw) -> GenerationSettings:
    return GenerationSettings(max_new_tokens=NEW, temperature=0, ignore_eos=True, **kw)


def test_penalties_count_the_output_only_as_the_formula_says(demo_runtime: ExLlamaRuntime, hf_model):
    ids = demo_runtime.encode(PROMPT)
    plain = demo_runtime.generate(PROMPT, settings=greedy())
    assert list(plain.token_ids) == oracle(hf_model, ids)
    for presence, frequency in ((1.5, 0.0), (0.0, 1.0), (0.5, 0.5), (-1.0, 0.0)):
        got = demo_runtime.generate(PROMPT, settings=greedy(presence_penalty=presence, frequency_penalty=frequency))
        assert list(got.token_ids) == oracle(hf_model, ids, presence, frequency), (presence, frequency)
    penalized = demo_runtime.generate(PROMPT, settings=greedy(frequency_penalty=2.0))
    # the prompt is not counted: the first token is the unpenalized one; later the output repeats itself less
    assert penalized.token_ids[0] == plain.token_ids[0]
    most = max(plain.token_ids.count(t) for t in plain.token_ids)
    assert max(penalized.token_ids.count(t) for t in penalized.token_ids) < most


def test_logit_bias_bans_and_forces_tokens(demo_runtime: ExLlamaRuntime, hf_model):
    ids = demo_runtime.encode(PROMPT)
    first = demo_runtime.generate(PROMPT, settings=greedy()).token_ids[0]
    banned = demo_runtime.generate(PROMPT, settings=greedy(logit_bias={first: -100}))
    assert banned.token_ids[0] != first and list(banned.token_ids) == oracle(hf_model, ids, bias={first: -100})
    forced = demo_runtime.encode(" Paris")[0]
    got = demo_runtime.generate(PROMPT, settings=greedy(logit_bias={forced: 100}))
    assert set(got.token_ids) == {forced}
    with pytest.raises(InvalidSettingsError, match="vocabulary"):
        demo_runtime.generate(PROMPT, settings=greedy(logit_bias={10**7: 1}))
    with pytest.raises(InvalidSettingsError, match="-100 to 100"):
        GenerationSettings().merged(logit_bias={1: 101})
    assert GenerationSettings(logit_bias={"5": -3}).logit_bias == {5: -3.0}  # OpenAI sends ids as JSON keys


def test_every_door_takes_them(demo_runtime: ExLlamaRuntime, demo_dir: Path):
    from openai import OpenAI
    from servers import demo_server

    from exllama_integrations.langchain import ChatExLlama, ExLlamaLLM

    url = demo_server()
    first = demo_runtime.generate(PROMPT, settings=greedy()).token_ids[0]
    kw = {"presence_penalty": 0.7, "frequency_penalty": 0.4, "logit_bias": {first: -100}}
    ref = demo_runtime.generate(PROMPT, settings=greedy(**kw))
    client = OpenAI(base_url=url + "/v1", api_key="none")
    served = client.completions.create(
        model=demo_runtime.model_name,
        prompt=PROMPT,
        max_tokens=NEW,
        temperature=0,
        presence_penalty=0.7,
        frequency_penalty=0.4,
        logit_bias={str(first): -100},
        extra_body={"ignore_eos": True},
    )
    assert served.choices[0].text == ref.text
    remote = ExLlamaLLM(base_url=url, temperature=0, max_new_tokens=NEW, presence_penalty=0.7, frequency_penalty=0.4)
    assert remote.invoke(PROMPT, logit_bias={first: -100}, ignore_eos=True) == ref.text
    local = ExLlamaLLM(model_dir=str(demo_dir), backend="transformers", temperature=0, max_new_tokens=NEW)
    assert local.invoke(PROMPT, ignore_eos=True, **kw) == ref.text
    chat = ChatExLlama(model_dir=str(demo_dir), backend="transformers", temperature=0, frequency_penalty=2.0)
    assert chat.invoke("Say la ten times.", max_tokens=NEW).content
