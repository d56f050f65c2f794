"""Images on exllamav3 against a transformers fp32 oracle: a Gemma 3 built by transformers' own classes.

``vision_models.make_vision("gemma3", size="gpu")``: text hidden 1024 x 8 layers, a SigLIP-shaped tower (hidden
768 x 12 layers, 448 px, 256 image tokens), bf16, written in the Hub's tensor layout. The oracle rule of the
architecture matrix: prefill logits and every decode step (while the greedy tokens agree) within 5% of the oracle
logits' standard deviation; the prompt ids equal the processor's at every text position and the image takes as
many positions. One line per image goes to ``$OUT/vision_oracle.jsonl``.

Run on the lent GPU: ``pytest -m gpu tests/gpu/test_gpu_vision.py``. Skipped without CUDA.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
from vision_models import image_bytes, make_vision

pytestmark = pytest.mark.gpu
STEPS = 16
QUESTION = "What is in the picture?"
RESULTS = Path(os.environ.get("OUT", "/tmp/out")) / "vision_oracle.jsonl"
IMAGES = {
    "red-png": (image_bytes(300, 200, (200, 40, 40)), "image/png"),
    "green-jpeg": (image_bytes(640, 480, (30, 190, 60), "JPEG"), "image/jpeg"),
}


@pytest.fixture(scope="module")
def vl(tmp_path_factory) -> Path:
    return make_vision("gemma3", tmp_path_factory.mktemp("vl") / "gemma3-vl", size="gpu", seed=11, device="cuda")


@pytest.fixture(scope="module")
def rt(vl):
    from exllama_integrations import ExLlamaRuntime

    runtime = ExLlamaRuntime(vl, "exllamav3", cache_size=16384)
    yield runtime
    runtime.close()


def _messages(*turns: str) -> tuple[dict, ...]:
    first = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}
    rest = [{"role": "assistant" if i % 2 == 0 else "user", "content": t} for i, t in enumerate(turns)]
    return (first, *rest)


def _oracle(path: Path, data: bytes):
    """The processor's prompt ids, transformers fp32's greedy tokens and its logits at prefill and each step."""
    import torch
    import transformers
    from PIL import Image

    processor = transformers.AutoProcessor.from_pretrained(str(path))
    model = transformers.AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).cuda().eval()
    text = processor.apply_chat_template(list(_messages()), add_generation_prompt=True, tokenize=False)
    enc = processor(
        text=[text], images=[Image.open(io.BytesIO(data)).convert("RGB")], return_tensors="pt", add_special_tokens=False
    )
    enc = {k: v.cuda() for k, v in enc.items()}
    n = enc["input_ids"].shape[1]
    with torch.inference_mode():
        out = model.generate(
            **enc, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        want = out[0, n:].tolist()
        full = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask", "token_type_ids")}
        types = torch.cat(
            [enc["token_type_ids"], torch.zeros((1, STEPS), dtype=enc["token_type_ids"].dtype, device="cuda")], 1
        )
        ref = model(input_ids=out, token_type_ids=types, **full).logits[0, n - 1 : -1].float().cpu()
    ids = enc["input_ids"][0].tolist()
    image_token = model.config.image_token_index
    del model
    torch.cuda.empty_cache()
    return ids, image_token, want, ref


def _exllamav3_logits(rt, ids: list[int], embeddings: list, steps: int):
    """exllamav3's logits at each step of its own greedy decode (compared while its tokens agree with the oracle's)."""
    import torch
    from exllamav3 import ComboSampler, Job

    gen = rt.diagnostics()["generator"]
    job = Job(
        input_ids=torch.tensor([ids]),
        max_new_tokens=steps,
        sampler=ComboSampler(temperature=0),
        return_logits=True,
        stop_conditions=[],
        embeddings=embeddings,
    )
    gen.enqueue(job)
    logits, got = [], []
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            if r.get("stage") == "streaming":
                if r.get("logits") is not None:
                    logits.extend(r["logits"][0].float().cpu())
                if r.get("token_ids") is not None:
                    got.extend(r["token_ids"].flatten().tolist())
    return torch.stack(logits), got


@pytest.mark.parametrize("name", list(IMAGES))
def test_gemma3_images_on_exllamav3_match_the_oracle(vl, rt, name):
    from PIL import Image

    from exllama_integrations import GenerationRequest, GenerationSettings, Media
    from exllama_integrations.model.media import image_key

    data, mime = IMAGES[name]
    assert rt.model_info().accepts_images and rt.model_info().details["vision"] == "loaded"
    want_ids, image_token, want, ref = _oracle(vl, data)
    request = GenerationRequest(messages=_messages(), media=(Media(data, mime),))
    ids = rt.prompt_token_ids(request)
    vocab = rt.model_info().vocab_size
    assert len(ids) == len(want_ids), "the image takes as many positions as the processor gives it"
    assert all((a == b) if b != image_token else a >= vocab for a, b in zip(ids, want_ids))
    lib = rt.diagnostics()
    text = rt.chat_prompt(list(_messages()))
    _, embeddings = lib["vision"].encode(
        text,
        [Image.open(io.BytesIO(data)).convert("RGB")],
        [image_key(Media(data))],
        False,
        rt.tokenizer,
        lib["tokenizer"],
    )
    logits, got = _exllamav3_logits(rt, ids, embeddings, STEPS)
    agree = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
    n = min(agree + 1, len(logits))
    tol = 0.05 * ref.std().item()
    prefill = (logits[0, : ref.shape[1]] - ref[0]).abs().max().item()
    steps = (logits[:n, : ref.shape[1]] - ref[:n]).abs().amax(dim=-1).max().item()
    through = rt.generate(request, GenerationSettings(max_new_tokens=STEPS, temperature=0, ignore_eos=True))
    record = {
        "arch": "gemma3-vl",
        "image": name,
        "prompt_tokens": len(ids),
        "image_tokens": sum(1 for t in want_ids if t == image_token),
        "prefill_max_logit_diff": round(prefill, 4),
        "decode_max_logit_diff": round(steps, 4),
        "tolerance": round(tol, 4),
        "greedy_tokens_agree": agree,
        "runtime_tokens_agree": next((i for i, (a, b) in enumerate(zip(through.token_ids, want)) if a != b), STEPS),
        "usage_prompt_tokens": through.usage.prompt_tokens,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record))
    assert prefill <= tol and steps <= tol
    assert record["runtime_tokens_agree"] == agree and through.usage.prompt_tokens == len(want_ids)


def test_a_follow_up_turn_reuses_the_image_and_its_prefix(rt):
    from exllama_integrations import GenerationRequest, GenerationSettings, Media

    data, mime = image_bytes(512, 384, (120, 60, 200)), "image/png"
    vision = rt.diagnostics()["vision"]
    settings = GenerationSettings(max_new_tokens=8, temperature=0)
    first = rt.generate(GenerationRequest(messages=_messages(), media=(Media(data, mime),)), settings)
    misses, hits = vision.misses, vision.hits
    follow = rt.generate(
        GenerationRequest(messages=_messages(first.text, "And its colour?"), media=(Media(data, mime),)), settings
    )
    print(
        json.dumps(
            {
                "first_prompt": first.usage.prompt_tokens,
                "follow_up_prompt": follow.usage.prompt_tokens,
                "follow_up_cached": follow.usage.cached_tokens,
                "tower_runs": vision.misses - misses,
                "cache_hits": vision.hits - hits,
            }
        )
    )
    assert vision.misses == misses and vision.hits == hits + 1  # the tower did not run again
    assert follow.usage.cached_tokens >= first.usage.prompt_tokens - 256  # the image's pages came from the cache


def test_images_are_refused_typed_with_vision_off(vl):
    from exllama_integrations import ExLlamaRuntime, GenerationRequest, Media
    from exllama_integrations.errors import MediaError

    rt = ExLlamaRuntime(vl, "exllamav3", cache_size=4096, vision=False)
    try:
        assert not rt.model_info().accepts_images
        with pytest.raises(MediaError, match="vision=False"):
            rt.generate(GenerationRequest(messages=_messages(), media=(Media(IMAGES["red-png"][0]),)))
        assert (
            rt.generate(
                GenerationRequest(messages=({"role": "user", "content": "hi"},)), max_new_tokens=4
            ).usage.completion_tokens
            > 0
        )
    finally:
        rt.close()
