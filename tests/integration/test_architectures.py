"""The architectures people run, end to end on the CPU reference: built by transformers' own classes, decoded
by our loop exactly as transformers decodes them, and chatted with through LangChain and LlamaIndex.

The same families are checked on the GPU backends against a transformers fp32 oracle in tests/gpu (the
architecture table in docs/backends.md comes from those runs).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from arch_models import ARCHS, make_arch

from exllama_integrations import ExLlamaRuntime

NEW = 12


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("archs")
    return {name: make_arch(name, root / name, seed=i) for i, name in enumerate(ARCHS)}


def _oracle(path: Path, ids: list[int]) -> tuple[list[int], object]:
    """transformers' own greedy decoding of ``ids``, and the logits of each step."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=NEW,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=None,
            pad_token_id=0,
            min_new_tokens=NEW,
        )
    return out.sequences[0, len(ids) :].tolist(), torch.stack(out.logits)[:, 0]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ARCHS))
def test_each_architecture_decodes_as_transformers_does_and_chats_through_both_frameworks(models, name):
    from llama_index.core.base.llms.types import ChatMessage

    from exllama_integrations.langchain import ChatExLlama
    from exllama_integrations.llama_index import ExLlamaLLM

    rt = ExLlamaRuntime(models[name], "transformers")
    try:
        info = rt.model_info()
        assert (info.reasoning is not None) == ARCHS[name].reasons
        prompt = rt.chat_prompt([{"role": "user", "content": "hello there"}])
        ids = rt.encode(prompt)
        ours = rt.generate(tuple(ids), temperature=0, max_tokens=NEW, ignore_eos=True)
        want, logits = _oracle(models[name], ids)
        got = list(ours.token_ids)
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if first is not None:  # only at a near-tie of the oracle's own logits
            top2 = logits[first].topk(2).values
            assert float(top2[0] - top2[1]) < 1e-4, f"{name}: parts from transformers at token {first}"
        chat = ChatExLlama(runtime=rt, temperature=0, max_tokens=NEW)
        msg = chat.invoke("hello there")
        assert msg.usage_metadata["input_tokens"] > 0 and msg.response_metadata["model_name"] == models[name].name
        streamed = "".join(str(c.content) for c in chat.stream("hello there"))
        assert streamed == msg.content
        li = ExLlamaLLM(runtime=rt, temperature=0, max_new_tokens=NEW)
        r = li.chat([ChatMessage(role="user", content="hello there")])
        assert (
            r.message.content == msg.content and r.raw["usage"]["prompt_tokens"] == msg.usage_metadata["input_tokens"]
        )
        if name == "deepseek_r1_distill":  # its template opens the thinking block: everything it writes is thought
            assert msg.additional_kwargs.get("reasoning_content") or msg.response_metadata["finish_reason"] == "stop"
    finally:
        rt.close()
