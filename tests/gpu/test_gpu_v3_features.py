"""exllamav3 features against an oracle: LoRA adapters (fp16 and EXL3 weights) and speculative decoding.

Run on the lent GPU: ``pytest -m gpu tests/gpu``. Skipped without CUDA.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_gpu_backends import GREEDY, PROMPT, _assert_greedy_equivalent, _oracle_logits

from fixture_models import SMALL_GQA, convert_exl3, first_layers, make_llama, make_lora, merged

pytestmark = pytest.mark.gpu
TARGETS = ("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj")


@pytest.fixture(scope="module")
def lora_base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("lora")
    base = make_llama(root / "fp16", SMALL_GQA, seed=21)
    return base, make_lora(base, root / "adapter", seed=22, targets=TARGETS)


def test_exllamav3_lora_matches_the_merged_oracle(lora_base: tuple[Path, Path]) -> None:
    from exllama_integrations import ExLlamaRuntime
    from exllama_integrations.langchain import ExLlamaLLM

    base, adapter = lora_base
    oracle = ExLlamaRuntime(merged(base), "transformers", device="cuda", dtype="float32")
    want = oracle.generate(PROMPT, **GREEDY)
    ids = oracle.encode(PROMPT, add_special_tokens=True)
    oracle.close()
    ref = _oracle_logits(merged(base), ids)
    plain = ExLlamaRuntime(base, "exllamav3", cache_size=4096)
    without = plain.generate(PROMPT, **GREEDY).token_ids
    plain.close()
    rt = ExLlamaRuntime(base, "exllamav3", cache_size=4096, lora_dir=str(adapter))
    try:
        import torch

        with torch.inference_mode():
            logits = rt.diagnostics()["model"].forward(torch.tensor([ids], dtype=torch.long)).float()[0].cpu()
        diff = (logits[:, : ref.shape[1]] - ref).abs().max().item()
        tol = 0.05 * ref.std().item()
        llm = ExLlamaLLM(runtime=rt, temperature=0, max_new_tokens=64)
        streamed = "".join(llm.stream(PROMPT, ignore_eos=True))
        got = rt.generate(PROMPT, **GREEDY)
        print(
            f"exllamav3 + LoRA vs merged oracle: max logit diff {diff:.4f} (tolerance {tol:.4f}); "
            f"adapters {rt.model_info().details['lora']}"
        )
        assert diff <= tol
        assert got.token_ids != without  # the adapter changes the output
        _assert_greedy_equivalent(got.token_ids, want.token_ids, merged(base), ids, tol)
        assert streamed == got.text
    finally:
        rt.close()


def test_exllamav3_lora_on_exl3_weights_shapes_every_decoded_token(
    lora_base: tuple[Path, Path], tmp_path: Path
) -> None:
    """On EXL3 weights, decoded tokens follow the adapter: each is the argmax of a full forward (LoRA applied)."""
    import torch

    from exllama_integrations import ExLlamaRuntime

    base, adapter = lora_base
    exl3 = tmp_path / "exl3"
    convert_exl3(base, exl3, bits=4, cal_rows=16, cal_cols=256, timeout=400)

    def decode_vs_forward(rt: ExLlamaRuntime) -> tuple[int, tuple[int, ...]]:
        """Decoded tokens the full forward would not pick (beyond a near-tie of 0.1 of the logits' std)."""
        ids = rt.encode(PROMPT, add_special_tokens=True)
        got = rt.generate(ids, temperature=0, max_new_tokens=32, ignore_eos=True).token_ids
        with torch.inference_mode():
            full = rt.diagnostics()["model"].forward(torch.tensor([ids + list(got)], dtype=torch.long)).float()[0]
        steps = full[len(ids) - 1 : -1]
        gap = steps.max(dim=-1).values - steps.gather(1, torch.tensor(got, device=steps.device)[:, None])[:, 0]
        return int((gap > 0.1 * steps.std()).sum()), got

    rt = ExLlamaRuntime(exl3, "exllamav3", cache_size=4096, lora_dir=str(adapter))
    try:
        wrong, got = decode_vs_forward(rt)
        unfused = rt.model_info().details
    finally:
        rt.close()
    # what exllamav3 does on its own: the same adapter, its fused decode paths left on
    from exllamav3.model.lora import LoRA

    raw = ExLlamaRuntime(exl3, "exllamav3", cache_size=4096)
    try:
        plain = raw.generate(PROMPT, temperature=0, max_new_tokens=32, ignore_eos=True).token_ids
        LoRA.from_directory(raw.diagnostics()["model"], str(adapter))
        raw_wrong, _ = decode_vs_forward(raw)
    finally:
        raw.close()
    print(
        f"EXL3 + LoRA: {wrong}/32 decoded tokens are not the LoRA forward's choice with our unfused paths "
        f"({unfused['lora_fused_paths_off']} fused paths turned off); with exllamav3's fused paths left on: "
        f"{raw_wrong}/32"
    )
    assert wrong == 0
    assert got != plain


@pytest.fixture(scope="module")
def draft_pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec")
    target = make_llama(root / "target", SMALL_GQA, seed=31, zero_after=2)
    return {
        "target": target,
        "perfect": first_layers(target, root / "perfect", 2),  # predicts the target exactly
        "unrelated": make_llama(root / "unrelated", dataclasses.replace(SMALL_GQA, layers=2), seed=32),
    }


@pytest.mark.parametrize("draft", ["perfect", "unrelated", "ngram"])
def test_speculative_decoding_is_greedy_identical(draft_pair: dict[str, Path], draft: str) -> None:
    from exllama_integrations import ExLlamaRuntime
    from exllama_integrations.contract.api import Grammar
    from exllama_integrations.langchain import ExLlamaLLM

    prompts = [PROMPT, "a b c a b c a b c a b c", "one two three four", "the lazy dog sleeps"]
    schema = Grammar.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    plain = ExLlamaRuntime(draft_pair["target"], "exllamav3", cache_size=8192)
    try:
        t0 = time.perf_counter()
        want = [plain.generate(p, **GREEDY) for p in prompts]
        t_plain = time.perf_counter() - t0
        want_json = plain.generate(PROMPT, grammar=schema, temperature=0, max_new_tokens=48)
    finally:
        plain.close()
    opts = {"ngram_match_min": 2} if draft == "ngram" else {"draft_model_dir": str(draft_pair[draft])}
    rt = ExLlamaRuntime(draft_pair["target"], "exllamav3", cache_size=8192, num_draft_tokens=4, **opts)
    try:
        t0 = time.perf_counter()
        got = [rt.generate(p, **GREEDY) for p in prompts]
        t_spec = time.perf_counter() - t0
        with ThreadPoolExecutor(4) as ex:  # dynamic batching: four jobs drafting together
            together = list(ex.map(lambda p: rt.generate(p, **GREEDY), prompts))
        llm = ExLlamaLLM(runtime=rt, temperature=0, max_new_tokens=64)
        streamed = "".join(llm.stream(PROMPT, ignore_eos=True))
        got_json = rt.generate(PROMPT, grammar=schema, temperature=0, max_new_tokens=48)
        print(
            f"speculative ({draft}): 4 prompts x 64 greedy tokens in {t_spec:.2f}s vs {t_plain:.2f}s plain; "
            f"json {got_json.text!r} ({got_json.finish_reason}); {rt.model_info().details['speculative']}"
        )
    finally:
        rt.close()
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.token_ids for g in together] == [w.token_ids for w in want]
    assert streamed == want[0].text
    assert got_json.token_ids == want_json.token_ids and got_json.constraint_complete == want_json.constraint_complete
