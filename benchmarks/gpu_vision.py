"""Images on exllamav3: ours (``ExLlamaRuntime``, ``GenerationRequest(media=...)``) vs exllamav3's multimodal path.

The model is ``tests/vision_models.make_vision("gemma3", size="gpu")`` (text hidden 1024 x 8 layers, a SigLIP-shaped
tower of hidden 768 x 12 layers at 448 px, 256 image tokens, bf16). Raw is exllamav3 as its
``examples/multimodal.py`` drives it, from its own Config/Model/Cache/Generator and vision component; ours is the
public runtime. Both start from the image file's bytes. Every repetition uses a fresh image (a new picture, so no
embedding cache helps), greedy, ``ignore_eos``; rows are interleaved, >= 5 repetitions, medians [min..max].

- ``single``: one image + 64 new tokens: time to first token (image decode and the vision tower included) and
  decode tokens/s.
- ``batch16``: 16 image requests at once (ours: ``ExLlamaRuntime.batch``; raw: 16 jobs enqueued together).
- ``follow_up``: a second turn about the same picture (the embedding cache and the prefix cache) vs the same
  turn about a new picture of the same size.

    python benchmarks/gpu_vision.py --out DIR --reps 5
"""

from __future__ import annotations

import io
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _common import Results, parser  # noqa: E402

QUESTION = "Describe the picture."


def picture(rng: random.Random) -> bytes:
    """A fresh 640 x 480 JPEG: random colours and shapes."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (640, 480), tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(img)
    for _ in range(12):
        x, y = rng.randrange(600), rng.randrange(440)
        draw.rectangle(
            (x, y, x + rng.randrange(20, 200), y + rng.randrange(20, 200)),
            fill=tuple(rng.randrange(256) for _ in range(3)),
        )
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def turns(*more: str) -> tuple[dict, ...]:
    first = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}
    return (first, *({"role": "assistant" if i % 2 == 0 else "user", "content": t} for i, t in enumerate(more)))


class Raw:
    """exllamav3's own multimodal path, as its example drives it."""

    def __init__(self, model_dir: Path, prompt: str) -> None:
        from exllamav3 import Cache, Config, Generator, Model, Tokenizer

        config = Config.from_directory(str(model_dir))
        self.vision = Model.from_config(config, component="vision")
        self.vision.load(progressbar=False)
        self.model = Model.from_config(config)
        self.cache = Cache(self.model, max_num_tokens=65536)
        self.model.load(progressbar=False)
        self.tokenizer = Tokenizer.from_config(config)
        self.generator = Generator(self.model, self.cache, self.tokenizer, max_batch_size=64)
        self.prompt = prompt

    def run(self, images: list[bytes], new: int) -> dict[str, float]:
        import torch
        from exllamav3 import ArgmaxSampler, Job
        from PIL import Image

        t0 = time.perf_counter()
        jobs = []
        for data in images:
            with torch.inference_mode():
                emb = self.vision.get_image_embeddings(tokenizer=self.tokenizer, image=Image.open(io.BytesIO(data)))
            text = self.prompt.replace("<start_of_image>", "\n\n" + emb.text_alias + "\n\n")
            ids = self.tokenizer.encode(text, encode_special_tokens=True, embeddings=[emb])
            job = Job(input_ids=ids, max_new_tokens=new, sampler=ArgmaxSampler(), stop_conditions=[], embeddings=[emb])
            jobs.append(job)
            self.generator.enqueue(job)
        first: dict[int, float] = {}
        tokens = 0
        with torch.inference_mode():
            while self.generator.num_remaining_jobs():
                for r in self.generator.iterate():
                    t = r.get("token_ids")
                    if t is not None and t.numel():
                        tokens += t.numel()
                        first.setdefault(id(r["job"]), time.perf_counter() - t0)
        wall = time.perf_counter() - t0
        assert tokens == len(images) * new, tokens
        return _row(sorted(first.values()) if len(images) == 1 else None, wall, tokens)


def _row(firsts: list[float] | None, wall: float, tokens: int) -> dict[str, float]:
    """tok/s over the whole call; with one request, its time to first token and decode tok/s after it."""
    if firsts is None:
        return {"tok_s": tokens / wall, "wall_s": wall}
    ttft = firsts[0]
    return {
        "ttft_s": ttft,
        "tok_s": tokens / wall,
        "decode_tok_s": (tokens - 1) / max(wall - ttft, 1e-9),
        "wall_s": wall,
    }


def ours(rt, images: list[bytes], new: int, more: tuple[str, ...] = ()) -> dict[str, float]:
    from exllama_integrations import GenerationRequest, GenerationSettings, Media

    settings = GenerationSettings(max_new_tokens=new, temperature=0, ignore_eos=True)
    requests = [
        GenerationRequest(messages=turns(*more), media=(Media(d, "image/jpeg"),), settings=settings) for d in images
    ]
    t0 = time.perf_counter()
    if len(requests) == 1:
        first = None
        n = 0
        for chunk in rt.stream(requests[0]):
            if first is None and chunk.token_ids:
                first = time.perf_counter() - t0
            n += len(chunk.token_ids)
        assert n == new, n
        return _row([first or 0.0], time.perf_counter() - t0, new)
    results = rt.batch(requests)
    wall = time.perf_counter() - t0
    assert all(r.usage.completion_tokens == new for r in results)
    return _row(None, wall, len(results) * new)


def main() -> None:
    import torch
    from vision_models import make_vision

    from exllama_integrations import ExLlamaRuntime

    ap = parser(__doc__)
    ap.add_argument("--sections", default="single,batch16,follow_up")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sections = args.sections.split(",")
    model_dir = make_vision("gemma3", Path("/tmp/bench-gemma3-vl"), size="gpu", seed=5, device="cuda")
    torch.cuda.empty_cache()
    results = Results("gpu_vision.json")
    rt = ExLlamaRuntime(model_dir, "exllamav3", cache_size=65536)
    raw = Raw(model_dir, rt.chat_prompt(list(turns())))
    probe = rt.prompt_token_ids(ours_request(picture(random.Random(1)), 1))
    results.note(args.out, "model", {"prompt_tokens": len(probe), "details": rt.model_info().details})
    rng = random.Random(0)
    ours(rt, [picture(rng)], 8)  # warm both paths once (kernels, allocator)
    raw.run([picture(rng)], 8)
    new = 64
    if "single" in sections:
        runs: dict[str, list[dict[str, float]]] = {"ours": [], "raw": []}
        for rep in range(args.reps):
            for name in ("ours", "raw") if rep % 2 == 0 else ("raw", "ours"):
                img = [picture(rng)]
                runs[name].append(ours(rt, img, new) if name == "ours" else raw.run(img, new))
        for name, rows in runs.items():
            results.record(args.out, "single", name, rows)
        results.ratios(args.out, "single", [("ours", "raw")])
    if "batch16" in sections:
        runs = {"ours": [], "raw": []}
        for rep in range(args.reps):
            for name in ("ours", "raw") if rep % 2 == 0 else ("raw", "ours"):
                imgs = [picture(rng) for _ in range(16)]
                runs[name].append(ours(rt, imgs, new) if name == "ours" else raw.run(imgs, new))
        for name, rows in runs.items():
            results.record(args.out, "batch16", name, rows)
        results.ratios(args.out, "batch16", [("ours", "raw")])
    if "follow_up" in sections:
        runs = {"same_picture": [], "new_picture": []}
        vision = rt.diagnostics()["vision"]
        for _ in range(args.reps):
            img = picture(rng)
            reply = rt.generate(ours_request(img, 16)).text
            for name in ("same_picture", "new_picture"):
                runs[name].append(
                    ours(rt, [img if name == "same_picture" else picture(rng)], 16, (reply, "And the colours?"))
                )
        for name, rows in runs.items():
            results.record(args.out, "follow_up", name, rows)
        results.ratios(args.out, "follow_up", [("same_picture", "new_picture")])
        results.note(args.out, "image_cache", {"hits": vision.hits, "misses": vision.misses})
    rt.close()


def ours_request(img: bytes, new: int):
    from exllama_integrations import GenerationRequest, GenerationSettings, Media

    return GenerationRequest(
        messages=turns(),
        media=(Media(img, "image/jpeg"),),
        settings=GenerationSettings(max_new_tokens=new, temperature=0),
    )


if __name__ == "__main__":
    main()
