"""The families people run in December 2026, end to end on the CPU reference, each a tiny model of its family.

Qwen3.5 (dense, MoE: Gated DeltaNet layers with recurrent state between attention layers, and the MTP head its
checkpoints carry), Qwen3-Next, Gemma 4, GLM-4.5 (MoE) and its MLA "lite", DeepSeek-V3.x (MLA + MoE) and V4,
MiniMax-M2, Nemotron-H (Mamba-2 hybrid) and Kimi Linear, built by transformers' own classes with the family's chat
template (tests/data/chat_templates) and tokens (``arch_families.ARCHS_2026``). Each decodes exactly as transformers
decodes it, alone and beside another request (a recurrent state is each request's own), a second turn gives the
tokens a cold run gives, and it chats through LangChain, LlamaIndex and the server with tools and its thinking.
Their tool formats are read, forced and rendered in tests/integration/test_tool_calls_by_family.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from arch_families import ARCHS_2026
from arch_models import make_arch
from tool_families import TOOLS

from exllama_integrations import ExLlamaRuntime

NEW = 8
QUESTION = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families_2026")
    return {name: make_arch(arch, root / name, seed=100 + i) for i, (name, arch) in enumerate(ARCHS_2026.items())}


def _oracle(model, ids: list[int]) -> tuple[list[int], object]:
    """transformers' own greedy decoding of ``ids`` (a cold run), and the logits of each step."""
    import torch

    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out.sequences[0, len(ids) :].tolist(), torch.stack(out.logits)[:, 0]


def _same(name: str, got: list[int], want: list[int], logits) -> None:
    """The same tokens, or parted only at a near-tie of the oracle's own logits."""
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if first is not None:
        top2 = logits[first].topk(2).values
        assert float(top2[0] - top2[1]) < 1e-4, f"{name}: parts from transformers at token {first}: {got} {want}"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ARCHS_2026))
def test_each_family_decodes_as_transformers_does_alone_beside_another_and_on_a_second_turn(models, name):
    import torch
    from transformers import AutoModelForCausalLM

    oracle = AutoModelForCausalLM.from_pretrained(str(models[name]), dtype=torch.float32).eval()
    rt = ExLlamaRuntime(models[name], "transformers")
    try:
        assert (rt.model_info().reasoning is not None) == ARCHS_2026[name].reasons
        first_ids = rt.encode(rt.chat_prompt(QUESTION))
        other_ids = rt.encode(rt.chat_prompt([{"role": "user", "content": "tell me about the sea"}]))
        want, logits = _oracle(oracle, first_ids)
        want_other, logits_other = _oracle(oracle, other_ids)
        alone = rt.generate(tuple(first_ids), temperature=0, max_tokens=NEW, ignore_eos=True)
        _same(name, list(alone.token_ids), want, logits)
        # two requests decoding together: each keeps its own recurrent state and KV
        together = rt.batch([tuple(first_ids), tuple(other_ids)], temperature=0, max_tokens=NEW, ignore_eos=True)
        _same(name, list(together[0].token_ids), want, logits)
        _same(name, list(together[1].token_ids), want_other, logits_other)
        # a second turn after the first: the tokens of a cold run of the whole conversation
        answer = rt.decode(list(alone.token_ids))
        turn2 = [*QUESTION, {"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
        second_ids = rt.encode(rt.chat_prompt(turn2))
        want2, logits2 = _oracle(oracle, second_ids)
        second = rt.generate(tuple(second_ids), temperature=0, max_tokens=NEW, ignore_eos=True)
        _same(name, list(second.token_ids), want2, logits2)
        assert second.usage.cached_tokens == 0  # the CPU reference keeps no prefix cache: every turn is cold
    finally:
        rt.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ARCHS_2026))
def test_each_family_chats_with_tools_through_langchain_llamaindex_and_the_server(models, name):
    import openai
    from llama_index.core.base.llms.types import ChatMessage
    from servers import ThreadServer

    from exllama_integrations.langchain import ChatExLlama
    from exllama_integrations.llama_index import ExLlamaLLM

    rt = ExLlamaRuntime(models[name], "transformers")
    server = ThreadServer(rt)
    try:
        budget = {"max_reasoning_tokens": 3} if ARCHS_2026[name].reasons else {}
        chat = ChatExLlama(runtime=rt, temperature=0, max_tokens=NEW, **budget).bind_tools(TOOLS)
        msg = chat.invoke("hello there")
        assert msg.usage_metadata["input_tokens"] > 0 and msg.response_metadata["model_name"] == models[name].name
        thought = (msg.usage_metadata.get("output_token_details") or {}).get("reasoning", 0)
        assert thought <= 4  # the reasoning budget holds (3, and the block's close)
        chunks = list(chat.stream("hello there"))
        full = chunks[0]
        for c in chunks[1:]:
            full = full + c
        assert full.content == msg.content
        assert [c["name"] for c in full.tool_calls] == [c["name"] for c in msg.tool_calls]
        li = ExLlamaLLM(runtime=rt, temperature=0, max_new_tokens=NEW, **budget)
        r = li.chat([ChatMessage(role="user", content="hello there")], tools=TOOLS)
        assert r.raw["usage"]["prompt_tokens"] == msg.usage_metadata["input_tokens"]
        assert r.raw["usage"]["completion_tokens"] == msg.usage_metadata["output_tokens"]  # the same greedy reply
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(
            model=name, messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=NEW, extra_body=budget
        )
        assert reply.usage.prompt_tokens == msg.usage_metadata["input_tokens"]
        assert reply.usage.completion_tokens == msg.usage_metadata["output_tokens"]
        assert reply.choices[0].finish_reason == msg.response_metadata["finish_reason"]
        assert [c.function.name for c in reply.choices[0].message.tool_calls or []] == [
            c["name"] for c in msg.tool_calls
        ]
    finally:
        server.stop()
        rt.close()


def test_the_qwen3_5_fixture_carries_its_mtp_head_as_the_checkpoints_do(models):
    """``mtp.*`` beside the trunk (under ``model.language_model.``), ``mtp_num_hidden_layers`` in the config."""
    import json

    from safetensors import safe_open

    for name in ("qwen3_5", "qwen3_5_moe"):
        config = json.loads((models[name] / "config.json").read_text())
        assert config["mtp_num_hidden_layers"] == 1
        with safe_open(str(models[name] / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
        assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_hidden.weight"} <= keys
        assert any(k.startswith("mtp.layers.0.self_attn.q_proj") for k in keys)
        assert not any(k.startswith("model.layers.") for k in keys)
        assert "model.language_model.embed_tokens.weight" in keys


def test_the_docs_table_has_a_cpu_row_for_each_family():
    """docs/backends.md names each family's class with "yes" on the CPU reference (the tests above are the claim)."""
    import re

    page = (Path(__file__).parents[2] / "docs" / "backends.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| [^|]*\(`(\w+)`\) \| (\w+) \|", page, re.M)}
    for arch in ARCHS_2026.values():
        assert rows.get(arch.model) == "yes", arch.model


@pytest.mark.slow
def test_the_carried_gpu_fixture_and_its_oracle_match_the_cpu_reference(tmp_path):
    """tests/gpu/build_family_fixtures.py's oracle, read back by tests/gpu/family_matrix.py on the CPU reference:
    every logit row and greedy token the same, a second turn warm as cold (what the GPU run checks on exllamav3)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "gpu"))
    from build_family_fixtures import build
    from family_matrix import check_family

    built = build("glm4_moe", tmp_path / "glm4_moe", seed=7, steps=4)
    assert built["architecture"] == "Glm4MoeForCausalLM" and built["turns_share_tokens"] > 2048
    row = check_family(tmp_path / "glm4_moe", ("load", "oracle", "prefix"), backend="transformers")
    assert row["status"] == "ok" and row["decode_max_logit_diff"] == 0.0 and row["greedy_tokens_agree"] == 4, row
    assert row["prefix"]["warm_equals_cold"] and row["prefix"]["warm_tokens_agree_with_oracle"] == 8, row["prefix"]
