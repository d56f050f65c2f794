"""Images in, end to end on the CPU reference: a random-weight Gemma 3 built by transformers' own classes.

The oracle is transformers itself: the model's processor and ``generate`` on the same weights and image. Every
front door (the runtime, LangChain, LlamaIndex, the server with the openai client and ``ChatOpenAI``,
``RemoteRuntime``) must give the oracle's greedy reply for the image, so an image that is dropped, misplaced or
decoded differently anywhere fails here. Bad images are refused typed and fast at every door.
"""

from __future__ import annotations

import atexit
import base64
import functools
import gc
import http.server
import io
import shutil
import struct
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vision_models import image_bytes, make_vision  # noqa: E402

from exllama_integrations import ExLlamaRuntime, GenerationRequest, GenerationSettings, Media  # noqa: E402
from exllama_integrations.errors import MediaError  # noqa: E402

QUESTION = "What is in the picture?"
RED = image_bytes(color=(200, 40, 40))
GREEN = image_bytes(120, 90, color=(30, 190, 60), fmt="JPEG")
NEW = 6


@functools.lru_cache(maxsize=1)
def vl_model_dir() -> Path:
    """The tiny Gemma 3 of this module, built once per test process."""
    root = Path(tempfile.mkdtemp(prefix="exllama-vl-"))
    atexit.register(shutil.rmtree, root, True)
    return make_vision("gemma3", root / "gemma3-vl", seed=3)


@pytest.fixture(scope="module")
def vl_dir() -> Path:
    return vl_model_dir()


@pytest.fixture(scope="module")
def rt(vl_dir: Path) -> ExLlamaRuntime:
    runtime = ExLlamaRuntime(vl_dir, "transformers")
    yield runtime
    runtime.close()


@pytest.fixture(scope="module")
def oracle(vl_dir: Path, rt: ExLlamaRuntime):
    """transformers' own greedy reply (as text, cut at the end of turn) and prompt length for an image."""
    import transformers
    from PIL import Image

    processor = transformers.AutoProcessor.from_pretrained(str(vl_dir))
    model = transformers.AutoModelForImageTextToText.from_pretrained(str(vl_dir)).eval()
    stops = set(rt.model_info().eos_token_ids)
    memo: dict[bytes, tuple[str, int]] = {}

    def reply(data: bytes) -> tuple[str, int]:
        if data not in memo:
            msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
            text = processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            image = Image.open(io.BytesIO(data)).convert("RGB")
            enc = processor(text=[text], images=[image], return_tensors="pt", add_special_tokens=False)
            out = model.generate(**enc, max_new_tokens=NEW, do_sample=False)[0, enc["input_ids"].shape[1] :].tolist()
            cut = next((i for i, t in enumerate(out) if t in stops), len(out))
            memo[data] = (rt.decode(out[:cut]), enc["input_ids"].shape[1])
        return memo[data]

    return reply


def user_turn(*parts: dict) -> tuple[dict, ...]:
    return ({"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]},)


def greedy(**kw) -> GenerationSettings:
    return GenerationSettings(**{"max_new_tokens": NEW, "temperature": 0, **kw})


def test_the_runtime_reads_an_image_as_transformers_does(rt, oracle):
    info = rt.model_info()
    assert info.accepts_images and info.details["vision"] == "loaded"
    for data, mime in ((RED, "image/png"), (GREEN, "image/jpeg")):
        result = rt.generate(
            GenerationRequest(messages=user_turn({"type": "image"}), media=(Media(data, mime),), settings=greedy())
        )
        text, prompt_len = oracle(data)
        assert result.text == text
        assert result.usage.prompt_tokens == prompt_len  # the image counted as the tokens the model reads it as
        assert prompt_len > len(rt.encode(QUESTION)) + 16


def test_the_image_is_what_the_model_sees(rt):
    """Two pictures give two first-token distributions; the same picture twice gives the same one."""

    def first(data: bytes) -> tuple:
        r = rt.generate(
            GenerationRequest(
                messages=user_turn({"type": "image"}),
                media=(Media(data),),
                settings=greedy(logprobs=3, max_new_tokens=1),
            )
        )
        return tuple(round(t.logprob, 4) for t in r.logprobs[0].top)

    assert first(RED) == first(RED)
    assert first(RED) != first(GREEN)


def test_langchain_takes_every_image_block_shape(rt, oracle):
    from langchain_core.messages import HumanMessage

    from exllama_integrations.langchain import ChatExLlama

    chat = ChatExLlama(runtime=rt, temperature=0, max_tokens=NEW)
    b64 = base64.b64encode(RED).decode()
    shapes = [
        {"type": "image", "base64": b64, "mime_type": "image/png"},  # LangChain v1
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}},  # OpenAI's
        {"type": "image", "source_type": "base64", "data": b64, "mime_type": "image/png"},  # LangChain v0
        {"type": "image", "url": f"data:image/png;base64,{b64}"},
    ]
    assert chat.profile["image_inputs"] is True
    for block in shapes:
        msg = chat.invoke([HumanMessage(content=[block, {"type": "text", "text": QUESTION}])])
        assert msg.content == oracle(RED)[0], block["type"]
        assert msg.usage_metadata["input_tokens"] == oracle(RED)[1]
    streamed = "".join(
        c.content for c in chat.stream([HumanMessage(content=[shapes[0], {"type": "text", "text": QUESTION}])])
    )
    assert streamed == oracle(RED)[0]


def test_llama_index_takes_image_blocks(rt, oracle, tmp_path):
    from llama_index.core.base.llms.types import ChatMessage, ImageBlock, TextBlock

    from exllama_integrations.llama_index import ExLlamaLLM

    llm = ExLlamaLLM(runtime=rt, temperature=0, max_new_tokens=NEW)
    path = tmp_path / "green.jpg"
    path.write_bytes(GREEN)
    for block, data in ((ImageBlock(image=RED, image_mimetype="image/png"), RED), (ImageBlock(path=path), GREEN)):
        reply = llm.chat([ChatMessage(role="user", blocks=[block, TextBlock(text=QUESTION)])])
        assert reply.message.content == oracle(data)[0]


@pytest.fixture(scope="module")
def server(rt):
    from servers import ThreadServer

    s = ThreadServer(rt)
    yield s.url
    s.stop()


def test_the_server_takes_openai_image_parts(server, oracle):
    import openai

    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)
    url = "data:image/jpeg;base64," + base64.b64encode(GREEN).decode()
    msgs = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}],
        }
    ]
    done = client.chat.completions.create(model="gemma3-vl", messages=msgs, max_tokens=NEW, temperature=0)
    assert done.choices[0].message.content == oracle(GREEN)[0]
    assert done.usage.prompt_tokens == oracle(GREEN)[1]
    stream = client.chat.completions.create(
        model="gemma3-vl", messages=msgs, max_tokens=NEW, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == oracle(GREEN)[0]


def test_chat_openai_and_remote_runtime_carry_images(server, oracle):
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    b64 = base64.b64encode(RED).decode()
    chat = ChatOpenAI(base_url=server + "/v1", api_key="none", model="gemma3-vl", temperature=0, max_tokens=NEW)
    msg = chat.invoke(
        [
            HumanMessage(
                content=[{"type": "image", "base64": b64, "mime_type": "image/png"}, {"type": "text", "text": QUESTION}]
            )
        ]
    )
    assert msg.content == oracle(RED)[0]

    from exllama_integrations import RemoteRuntime
    from exllama_integrations.langchain import ChatExLlama

    served = ChatExLlama(base_url=server, temperature=0, max_tokens=NEW)  # the native wire form, images as base64
    msg = served.invoke([HumanMessage(content=[{"type": "image", "base64": b64, "mime_type": "image/png"}, QUESTION])])
    assert msg.content == oracle(RED)[0] and msg.usage_metadata["input_tokens"] == oracle(RED)[1]
    remote = RemoteRuntime(server)
    assert remote.model_info().accepts_images
    r = remote.generate(
        GenerationRequest(messages=user_turn({"type": "image"}), media=(Media(RED, "image/png"),), settings=greedy())
    )
    assert r.text == oracle(RED)[0]


def test_token_counts_include_the_images_before_anything_runs(rt, server, oracle):
    import httpx
    from langchain_core.messages import HumanMessage

    from exllama_integrations.langchain import ChatExLlama

    b64 = base64.b64encode(RED).decode()
    msg = HumanMessage(content=[{"type": "image", "base64": b64, "mime_type": "image/png"}, QUESTION])
    assert ChatExLlama(runtime=rt).get_num_tokens_from_messages([msg]) == oracle(RED)[1]
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64}}
    body = {"messages": [{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}]}
    counted = httpx.post(server + "/tokenize", json=body).json()
    assert counted["count"] == oracle(RED)[1] and counted["max_model_len"] == rt.context_length
    # over the native wire form: the client counts text itself and asks its server only about images
    assert ChatExLlama(base_url=server).get_num_tokens_from_messages([msg]) == oracle(RED)[1]
    from exllama_integrations import RemoteRuntime

    remote = RemoteRuntime(server)
    with_image = GenerationRequest(messages=user_turn({"type": "image"}), media=(Media(RED, "image/png"),))
    assert remote.prompt_token_ids(with_image) == rt.prompt_token_ids(with_image)
    text_only = GenerationRequest(messages=({"role": "user", "content": QUESTION},))
    assert remote.prompt_token_ids(text_only) == rt.prompt_token_ids(text_only)


# --------------------------------------------------------------------------- bad images


def _png_claiming(width: int, height: int) -> bytes:
    """A valid 1x1 PNG whose header claims ``width`` x ``height`` pixels (CRC fixed, so only the size is wrong)."""
    png = image_bytes(1, 1)
    ihdr = png[12:29]  # b"IHDR" + 13 bytes of data
    data = struct.pack(">II", width, height) + ihdr[12:]
    chunk = b"IHDR" + data
    return png[:8] + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk)) + png[33:]


def _bomb() -> bytes:
    """A real PNG of 10,000 x 10,000 one-bit pixels: ~12 KB that would decode to 100 million pixels."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", (10_000, 10_000)).save(buf, format="PNG")
    return buf.getvalue()


BAD = {
    "truncated": (RED[: len(RED) // 2], "image/png", "could not be read"),
    "a decompression bomb": (None, "image/png", "pixels"),
    "10^5 x 10^5 pixels claimed": (_png_claiming(100_000, 100_000), "image/png", "pixels"),
    "wrong MIME type": (RED, "text/plain", "not an image"),
    "not an image at all": (b"hello, world", "image/png", "could not be read"),
    "an SVG": (b"<svg xmlns='http://www.w3.org/2000/svg'/>", "image/svg+xml", "could not be read"),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_images_are_refused_typed_and_fast_at_every_door(rt, server, kind):
    import openai
    from langchain_core.messages import HumanMessage

    from exllama_integrations.langchain import ChatExLlama

    data, mime, words = BAD[kind]
    data = _bomb() if data is None else data
    t0 = time.perf_counter()
    with pytest.raises(MediaError, match=words):
        rt.generate(
            GenerationRequest(messages=user_turn({"type": "image"}), media=(Media(data, mime),), settings=greedy())
        )
    chat = ChatExLlama(runtime=rt, max_tokens=NEW)
    block = {"type": "image", "base64": base64.b64encode(data).decode(), "mime_type": mime}
    with pytest.raises(MediaError, match=words):
        chat.invoke([HumanMessage(content=[block])])
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)
    url = f"data:{mime};base64," + base64.b64encode(data).decode()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="gemma3-vl",
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
            max_tokens=2,
        )
    assert e.value.code == "invalid_media"
    assert time.perf_counter() - t0 < 10


def test_too_many_images_and_too_many_bytes_are_refused(rt):
    with pytest.raises(MediaError, match="at most 16 images"):
        rt.generate(
            GenerationRequest(
                messages=user_turn(*[{"type": "image"}] * 17), media=(Media(RED),) * 17, settings=greedy()
            )
        )
    with pytest.raises(MediaError, match="larger than"):
        rt.generate(
            GenerationRequest(
                messages=user_turn({"type": "image"}), media=(Media(b"\0" * (20 * 2**20 + 1)),), settings=greedy()
            )
        )


def test_images_the_prompt_does_not_place_are_refused(rt):
    with pytest.raises(MediaError, match="place"):
        rt.generate(
            GenerationRequest(messages=({"role": "user", "content": QUESTION},), media=(Media(RED),), settings=greedy())
        )


def test_a_text_only_model_refuses_images_typed(demo_runtime):
    with pytest.raises(MediaError, match="takes no images"):
        demo_runtime.generate(GenerationRequest("Hi", media=(Media(RED),), settings=greedy()))
    assert not demo_runtime.model_info().accepts_images
    from servers import demo_server

    from exllama_integrations import RemoteRuntime

    with pytest.raises(MediaError, match="takes no images"):  # raised by the server, the same class here
        RemoteRuntime(demo_server()).prompt_token_ids(GenerationRequest("Hi", media=(Media(RED),)))


# --------------------------------------------------------------------------- URLs


class _Images(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/red.png":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(RED)
        elif self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "file:///etc/passwd")
            self.end_headers()
        else:
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(b"<html></html>")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def image_host():
    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=host.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{host.server_address[1]}"
    host.shutdown()


def test_urls_are_fetched_in_process_bounded_and_never_redirected(rt, oracle, image_host):
    from langchain_core.messages import HumanMessage

    from exllama_integrations.langchain import ChatExLlama

    chat = ChatExLlama(runtime=rt, temperature=0, max_tokens=NEW)

    def ask(url):
        return chat.invoke([HumanMessage(content=[{"type": "image", "url": url}, {"type": "text", "text": QUESTION}])])  # noqa: E731

    assert ask(image_host + "/red.png").content == oracle(RED)[0]
    with pytest.raises(MediaError, match="redirect"):
        ask(image_host + "/moved")
    with pytest.raises(MediaError, match="not an image"):
        ask(image_host + "/page.html")
    with pytest.raises(MediaError, match="must be data:, http: or https:"):
        ask("file:///etc/passwd")


def test_the_server_fetches_urls_only_when_the_operator_allows(rt, image_host, oracle):
    import openai
    from servers import ThreadServer

    from exllama_integrations.model.media import MediaLimits
    from exllama_integrations.serve.app import ServeLimits

    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image_host + "/red.png"}},
                {"type": "text", "text": QUESTION},
            ],
        }
    ]
    allowed = MediaLimits(fetch_urls=True, fetch_allow=("127.0.0.1",))  # the test's image host is local
    closed, open_ = ThreadServer(rt), ThreadServer(rt, limits=ServeLimits(media=allowed))
    try:
        with pytest.raises(openai.BadRequestError, match="allow-image-urls"):
            openai.OpenAI(base_url=closed.url + "/v1", api_key="x", max_retries=0).chat.completions.create(
                model="gemma3-vl", messages=msgs, max_tokens=NEW
            )
        done = openai.OpenAI(base_url=open_.url + "/v1", api_key="x", max_retries=0).chat.completions.create(
            model="gemma3-vl", messages=msgs, max_tokens=NEW, temperature=0
        )
        assert done.choices[0].message.content == oracle(RED)[0]
    finally:
        closed.stop()
        open_.stop()


# --------------------------------------------------------------------------- a family whose processor needs more


def test_qwen_vl_without_its_processor_serves_text_and_says_why_not_images(tmp_path):
    """Qwen2.5-VL's processor needs torchvision in transformers 5: without it the model still serves text, and
    an image is refused with the reason and the fix; with it, the image path runs."""
    import importlib.util

    qdir = make_vision("qwen2_5_vl", tmp_path / "qwen25-vl")
    runtime = ExLlamaRuntime(qdir, "transformers")
    try:
        request = GenerationRequest(messages=user_turn({"type": "image"}), media=(Media(RED),), settings=greedy())
        if importlib.util.find_spec("torchvision") is None:
            assert not runtime.model_info().accepts_images
            with pytest.raises(MediaError, match="pip install torchvision"):
                runtime.generate(request)
        else:
            assert runtime.generate(request).usage.prompt_tokens > 16
        assert (
            runtime.generate(
                GenerationRequest(messages=({"role": "user", "content": "hi"},), settings=greedy())
            ).usage.completion_tokens
            > 0
        )
    finally:
        runtime.close()


# --------------------------------------------------------------------------- LangChain's standard image test


class TestStandardImageInputs(ChatModelIntegrationTests):
    """langchain-tests' image-input test with its flag on, on the tiny Gemma 3 (the rest of the standard suite
    runs on the demo model in test_chat_standard.py: a random-weight model cannot call tools or write JSON).

    The test downloads its picture from GitHub with ``httpx.get``; this machine reaches only PyPI, so that one
    download is served a local PNG. ``supports_image_urls`` stays off for the same reason (the model would fetch
    the URL itself: that path is tested above against a local host).
    """

    @pytest.fixture(autouse=True)
    def _local_picture(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import httpx

        monkeypatch.setattr(httpx, "get", lambda url, **kw: httpx.Response(200, content=RED))

    @property
    def chat_model_class(self) -> type:
        from exllama_integrations.langchain import ChatExLlama

        return ChatExLlama

    @property
    def chat_model_params(self) -> dict:
        return {"model_dir": str(vl_model_dir()), "backend": "transformers", "temperature": 0, "max_tokens": 8}

    @property
    def supports_image_inputs(self) -> bool:
        return True

    @property
    def supports_image_urls(self) -> bool:
        return False


for _name in dir(ChatModelIntegrationTests):  # only the image tests of the suite run on this model
    if _name.startswith("test_") and "image" not in _name:
        setattr(TestStandardImageInputs, _name, None)


def test_vision_off_takes_text_only(vl_dir):
    """``vision=False``: the model serves text and refuses images, saying why."""
    runtime = ExLlamaRuntime(vl_dir, "transformers", vision=False)
    try:
        assert not runtime.model_info().accepts_images
        with pytest.raises(MediaError, match="vision=False"):
            runtime.generate(
                GenerationRequest(messages=user_turn({"type": "image"}), media=(Media(RED),), settings=greedy())
            )
        assert (
            runtime.generate(GenerationRequest(messages=({"role": "user", "content": "hi"},), settings=greedy())).text
            is not None
        )
    finally:
        runtime.close()


def test_exllamav3_places_images_as_the_model_processor_does(rt, vl_dir):
    """exllamav3's placement (its image tokens between the runtime's text ids) gives the processor's prompt ids at
    every text position and as many image positions. The embedding is a stand-in with exllamav3's token layout
    (start, the image's own ids, end); the real one runs on the GPU against transformers (tests/gpu)."""
    import transformers
    from PIL import Image

    from exllama_integrations.backends.exllamav3.vision import PLACEHOLDERS, place

    processor = transformers.AutoProcessor.from_pretrained(str(vl_dir))
    start, end = rt.encode("<start_of_image>"), rt.encode("<end_of_image>")

    class Embedding:  # exllamav3's MMEmbedding: start, 16 ids of its own past the vocabulary, end
        def __init__(self, first: int) -> None:
            self.ids = [*start, *range(first, first + 16), *end]

        def token_list_at(self, position: int) -> list[int]:
            return self.ids

    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Compare"}, {"type": "image"}]}]
    text = rt.chat_prompt(msgs)
    ours = place(text, [Embedding(10_000), Embedding(20_000)], PLACEHOLDERS["gemma3"], rt.tokenizer, False)
    images = [Image.open(io.BytesIO(d)).convert("RGB") for d in (RED, GREEN)]
    theirs = processor(text=[text], images=images, add_special_tokens=False)["input_ids"][0]
    image_token = processor.tokenizer.convert_tokens_to_ids("<image_soft_token>")
    assert len(ours) == len(theirs)
    assert all((a >= 10_000) if b == image_token else a == b for a, b in zip(ours, theirs))


def test_images_cross_to_an_engine_process_and_read_the_same(vl_dir, oracle):
    with ExLlamaRuntime(vl_dir, "transformers", engine="process") as remote_engine:
        assert remote_engine.model_info().accepts_images
        for data, mime in ((RED, "image/png"), (GREEN, "image/jpeg")):
            request = GenerationRequest(
                messages=user_turn({"type": "image"}), media=(Media(data, mime),), settings=greedy()
            )
            result = remote_engine.generate(request)
            text, prompt_len = oracle(data)
            assert (result.text, result.usage.prompt_tokens) == (text, prompt_len)
            assert len(remote_engine.prompt_token_ids(request)) == prompt_len
        with pytest.raises(MediaError):
            remote_engine.generate(GenerationRequest("no place for it", media=(Media(RED, "image/png"),)))
        # images encoded for a count (/tokenize) and never submitted are dropped by the engine too (issue 34)
        (engine,) = remote_engine.diagnostics()["engines"]
        gc.collect()
        time.sleep(2.5)  # two pings: the first carries what to drop, the second's answer counts what is held
        assert engine.held_media == 0
