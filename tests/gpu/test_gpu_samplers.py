"""OpenAI's sampler settings on exllamav3 against the transformers oracle (fp32, same weights): logit_bias through
exllamav3's own step, presence and frequency penalties through ours (output only, as on every backend).

Run on the lent GPU: ``pytest -m gpu tests/gpu``. Skipped without CUDA.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fixture_models import SMALL_GQA, make_llama

pytestmark = pytest.mark.gpu
PROMPT = "the quick brown fox the quick brown fox the quick brown fox and then"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama(tmp_path_factory.mktemp("samplers") / "fp16", SMALL_GQA, seed=31)


def test_penalties_and_bias_decode_the_oracles_tokens_on_exllamav3(model: Path) -> None:
    from exllama_integrations import ExLlamaRuntime, GenerationSettings

    def greedy(**kw) -> GenerationSettings:  # noqa: ANN003
        return GenerationSettings(max_new_tokens=24, temperature=0, ignore_eos=True, **kw)

    with ExLlamaRuntime(model, "transformers", device="cuda", dtype="float32") as oracle:
        with ExLlamaRuntime(model, "exllamav3", cache_size=8192) as rt:
            plain = rt.generate(PROMPT, settings=greedy()).token_ids
            cases = {
                "presence 1.5": {"presence_penalty": 1.5},
                "frequency 1.0": {"frequency_penalty": 1.0},
                "both + rep 1.2": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2},
                "bias bans the first token": {"logit_bias": {plain[0]: -100.0}},
                "bias forces token 7": {"logit_bias": {7: 100.0}},
            }
            for name, kw in cases.items():
                ours = rt.generate(PROMPT, settings=greedy(**kw)).token_ids
                ref = oracle.generate(PROMPT, settings=greedy(**kw)).token_ids
                agree = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), len(ref))
                print(f"{name}: the first {agree}/{len(ref)} tokens agree with the oracle; not plain: {ours != plain}")
                # 16 greedy steps, as the architecture matrix compares (fp16 against fp32: a near-tie may split later)
                assert ours[:16] == ref[:16] and ours != plain
                for t, b in kw.get("logit_bias", {}).items():
                    assert (t not in ours) if b < 0 else set(ours) == {t}
            warm = GenerationSettings(
                max_new_tokens=24, temperature=0.8, seed=1, frequency_penalty=1.0, ignore_eos=True
            )
            sampled = rt.generate(PROMPT, settings=warm).token_ids
            assert len(sampled) == 24  # the step-by-step path (our penalty step with sampling warpers) runs
