"""No request kills the engine and admission counts work: grammar and regex budgets, generations counted per
request, prompts counted once (issue 49, hardening round 5, the server and engine half).

One engine-process runtime on the tiny random model (SmolLM2's tokenizer: nothing here needs a trained model's
answers) and one server over it are shared by the tests of this module; the
engine's watchdog runs on test time (pings every 0.2 s, hung after 3 s) and its grammar budget is 1 s.
"""

from __future__ import annotations

import dataclasses
import json
import random
import string
import threading
import time

import httpx
import pytest

from exllama_integrations import ExLlamaRuntime, GenerationRequest, GenerationSettings

pytestmark = pytest.mark.slow

ENGINE_GRAMMAR_SECONDS = 1.0
HUNG_AFTER = 3.0


def greedy(n: int = 8, **kw) -> GenerationSettings:
    return GenerationSettings(max_new_tokens=n, temperature=0, **kw)


@pytest.fixture(scope="module")
def engine(tiny_dir):
    """The tiny random model (SmolLM2's tokenizer) in an engine process (watchdog on test time, a 1 s grammar
    budget), and a server over it."""
    from servers import ThreadServer

    from exllama_integrations.model import grammar_worker
    from exllama_integrations.runtime.engine import client

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(client, "PING_EVERY", 0.2)
        mp.setattr(client, "HUNG_AFTER", HUNG_AFTER)
        with pytest.MonkeyPatch.context() as started:
            started.setattr(grammar_worker, "COMPILE_SECONDS", ENGINE_GRAMMAR_SECONDS)  # the engine's budget
            rt = ExLlamaRuntime(tiny_dir, "transformers", engine="process")
        server = ThreadServer(rt)
        try:
            yield rt, server.url
        finally:
            server.stop()
            rt.close()


def alternatives(n: int) -> str:
    """A Lark grammar of ``n`` nine-letter alternatives (60 000: 840 KB, seconds to compile, growing faster than n)."""
    rng = random.Random(n)
    return "start: " + " | ".join('"' + "".join(rng.choices(string.ascii_lowercase, k=9)) + '"' for _ in range(n))


class Beside:
    """A long greedy stream read on a thread while the test does something else (closed by :meth:`survived`)."""

    def __init__(self, rt: ExLlamaRuntime) -> None:
        request = GenerationRequest(prompt="Story: once upon a time", settings=greedy(4000, ignore_eos=True))
        self.stream = rt.stream(request)
        self.error: BaseException | None = None
        self.tokens = 0
        self.first = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        assert self.first.wait(30)

    def _read(self) -> None:
        try:
            for chunk in self.stream:
                self.tokens += len(chunk.token_ids)
                self.first.set()
        except BaseException as e:  # noqa: BLE001 - what the reader sees is the point
            self.error = e
            self.first.set()

    def survived(self, more: int = 5) -> bool:
        """Whether the stream still runs unharmed (``more`` tokens after now, within 30 s); then it is closed."""
        now, t0 = self.tokens, time.perf_counter()
        while self.tokens < now + more and self.error is None and time.perf_counter() - t0 < 30:
            time.sleep(0.05)
        alive = self.error is None and self.tokens >= now + more
        self.stream.close()
        self.thread.join(10)
        return alive and self.error is None


# ------------------------------------------------------------------ defect 1: a grammar never kills the engine


def test_a_raw_grammar_over_the_size_bound_is_refused_at_the_door(engine):
    from exllama_integrations.contract.api import MAX_GRAMMAR_CHARS

    rt, url = engine
    source = alternatives(60_000)
    assert len(source) > MAX_GRAMMAR_CHARS
    t0 = time.perf_counter()
    reply = httpx.post(
        url + "/v1/completions",
        json={"prompt": "Pick:", "max_tokens": 4, "grammar": {"kind": "lark", "source": source}},
        timeout=60,
    )
    took = time.perf_counter() - t0
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "invalid_grammar" and error["param"] == "grammar"
    assert str(MAX_GRAMMAR_CHARS) in error["message"] and "MAX_GRAMMAR_CHARS" in error["message"]
    assert took < 5, took  # refused before anything compiles it (840 KB arrive and are parsed meanwhile)
    assert rt.active_requests == 0


def test_a_grammar_that_compiles_for_seconds_fails_typed_and_the_engine_serves_on(engine, monkeypatch):
    """Compiled off the loops that answer: the stream beside it goes on, the engine is not declared hung, 400s."""
    from exllama_integrations.contract import grammar
    from exllama_integrations.model import grammar_worker

    rt, url = engine
    (pid,) = rt.diagnostics()["engine_pids"]
    big = {"prompt": "Pick:", "max_tokens": 4, "grammar": {"kind": "lark", "source": alternatives(60_000)}}
    monkeypatch.setattr(grammar, "MAX_GRAMMAR_CHARS", 1_000_000)  # past the door: the time budgets hold it
    beside = Beside(rt)
    # this process's own budget first: refused at it (the compile goes on behind, and is kept)
    monkeypatch.setattr(grammar_worker, "COMPILE_SECONDS", 0.2)
    t0 = time.perf_counter()
    reply = httpx.post(url + "/v1/completions", json=big, timeout=60)
    assert reply.status_code == 400 and "within 0.2 s" in reply.json()["error"]["message"], reply.text
    assert reply.json()["error"]["code"] == "invalid_grammar"
    assert time.perf_counter() - t0 < 3
    # then past it: the engine compiles it (~6 s on one core, twice its hung limit) on a worker, within its 1 s
    monkeypatch.setattr(grammar_worker, "COMPILE_SECONDS", 120.0)
    t1 = time.perf_counter()
    reply = httpx.post(url + "/v1/completions", json=big, timeout=120)
    answered = time.perf_counter() - t1
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "invalid_grammar" and f"within {ENGINE_GRAMMAR_SECONDS:g} s" in error["message"]
    assert beside.survived()  # the stream beside it was never cut
    assert rt.diagnostics()["engine_pids"] == [pid] and rt.diagnostics()["engines"][0].restarts == 0
    assert httpx.get(url + "/health").json()["status"] == "ok"
    assert rt.generate("Hi", settings=greedy(2)).usage.completion_tokens == 2
    print(f"840 KB grammar: refused here in {t1 - t0:.2f} s, by the engine {answered:.1f} s later; engine kept")


# ------------------------------------------------------------------ defects 2 and 7: admission counts work


@pytest.fixture(scope="module")
def image_host():
    """An image host on 127.0.0.1 that counts what it is asked for."""
    import http.server

    fetched: list[str] = []

    class Host(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            fetched.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(b"\x89PNG\r\n\x1a\n" + bytes(32))

        def log_message(self, *args: object) -> None:
            pass

    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Host)
    threading.Thread(target=host.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{host.server_address[1]}", fetched
    host.shutdown()


@pytest.fixture(scope="module")
def small(tiny_runtime):
    """A server over the tiny random model (text only) that runs 4 generations at once and fetches image URLs."""
    from servers import ThreadServer

    from exllama_integrations.model.media import MediaLimits
    from exllama_integrations.serve.app import ServeLimits

    media = MediaLimits(fetch_urls=True, fetch_allow=("127.0.0.1",))
    server = ThreadServer(tiny_runtime, limits=ServeLimits(max_pending=4, media=media))
    yield server
    server.stop()


class Holding:
    """``n`` generations held in flight on a server: a completions stream of ``n`` long choices, open until closed
    (the client's disconnect cancels them)."""

    def __init__(self, url: str, n: int) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "n": n, "stream": True}
        self._client = httpx.Client(timeout=60)
        self._cm = self._client.stream("POST", url + "/v1/completions", json=body)
        self.reply = self._cm.__enter__()
        assert self.reply.status_code == 200

    def close(self) -> None:
        self._cm.__exit__(None, None, None)
        self._client.close()


def _free(server) -> None:
    t0 = time.perf_counter()
    while server.app.state.serve.pending and time.perf_counter() - t0 < 10:
        time.sleep(0.02)
    assert server.app.state.serve.pending == 0


def _image_bodies(url: str, model: str) -> dict[str, dict]:
    part = {"type": "image_url", "image_url": {"url": url + "/a.png"}}
    return {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": [part]}], "max_tokens": 2},
        "/v1/messages": {
            "model": model,
            "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": url}}]}],
        },
        "/v1/messages/count_tokens": {
            "model": model,
            "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": url}}]}],
        },
        "/v1/responses": {
            "input": [{"role": "user", "content": [{"type": "input_image", "image_url": url + "/a.png"}]}],
            "max_output_tokens": 2,
        },
        "/tokenize": {"messages": [{"role": "user", "content": [part]}]},
    }


def test_every_chat_api_and_count_tokens_are_admitted_before_they_prepare_anything(small, image_host):
    host, fetched = image_host
    url, model = small.url, small.app.state.serve.name
    held = Holding(url, 4)  # the server is full
    try:
        for path, body in _image_bodies(host, model).items():
            reply = httpx.post(url + path, json=body, timeout=60)
            assert reply.status_code in (503, 529), (path, reply.text)  # Anthropic's API says 529 overloaded
            assert reply.headers.get("retry-after"), path
        text = {"model": model, "messages": [{"role": "user", "content": "Hi " * 50_000}]}
        assert httpx.post(url + "/v1/messages/count_tokens", json=text, timeout=60).status_code == 529
    finally:
        held.close()
    assert fetched == []  # refused before any image was fetched
    _free(small)
    counted = httpx.post(url + "/v1/messages/count_tokens", json=text, timeout=60)
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 50_000


def test_a_text_only_model_fetches_no_image(small, image_host):
    host, fetched = image_host
    url, model = small.url, small.app.state.serve.name
    for path, body in _image_bodies(host, model).items():
        reply = httpx.post(url + path, json=body, timeout=60)
        assert reply.status_code == 400 and "takes no images" in reply.text, (path, reply.text)
    assert fetched == []
    _free(small)


def test_a_request_counts_as_its_generations(small):
    url = small.url
    many = {"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 1}  # 6 generations: more than the server's 4 ...
    reply = httpx.post(url + "/v1/completions", json=many, timeout=60)
    assert reply.status_code == 200 and len(reply.json()["choices"]) == 6, reply.text  # ... so it runs alone
    _free(small)
    held = Holding(url, 1)
    try:
        assert httpx.post(url + "/v1/completions", json=many, timeout=60).status_code == 503
        four = {"prompt": ["a", "b"], "n": 2, "max_tokens": 1, "temperature": 1}  # 1 + 4 > 4
        assert httpx.post(url + "/v1/completions", json=four, timeout=60).status_code == 503
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 1}
        assert httpx.post(url + "/v1/chat/completions", json={**chat, "n": 4}, timeout=60).status_code == 503
        assert httpx.post(url + "/v1/chat/completions", json={**chat, "n": 3}, timeout=60).status_code == 200
    finally:
        held.close()
    _free(small)


def test_max_tokens_bounds_each_generation_on_every_api(tiny_runtime):
    from servers import ThreadServer

    from exllama_integrations.serve.app import ServeLimits

    capped = ThreadServer(tiny_runtime, limits=ServeLimits(max_tokens=3))
    url, model = capped.url, capped.app.state.serve.name
    said = [{"role": "user", "content": "Tell me a long story."}]
    over = {
        "/v1/completions": {"prompt": "Once", "max_tokens": 4},
        "/v1/chat/completions": {"messages": said, "max_completion_tokens": 4},
        "/v1/responses": {"input": "Tell me a long story.", "max_output_tokens": 4},
        "/v1/messages": {"model": model, "messages": said, "max_tokens": 4},
    }
    for path, body in over.items():
        reply = httpx.post(url + path, json=body, timeout=60)
        assert reply.status_code == 400 and "at most 3" in reply.text, (path, reply.text)
    # a request that sets none gets the cap for each of its choices
    body = {"prompt": "Once upon a time", "n": 2, "temperature": 1, "ignore_eos": True}
    usage = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["usage"]
    capped.stop()
    assert usage["completion_tokens"] == 6


# ------------------------------------------------------------------ the minor list: what a request is counted as


def _scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        s.name: s.value for f in text_string_to_metric_families(httpx.get(url + "/metrics").text) for s in f.samples
    }


USAGE = {"include_usage": True}


def test_a_requests_log_line_and_metrics_count_its_prompt_once_and_every_choice(small, caplog):
    import logging

    url = small.url
    caplog.set_level(logging.INFO, logger="exllama_integrations.serve")
    for path, body, prompts, n in [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 2}, 1, 2),
        ("/v1/completions", {"prompt": ["Once upon", "The capital of"], "n": 2}, 2, 2),
        (
            "/v1/completions",
            {"prompt": "Once upon", "n": 2, "stream": True, "stream_options": {"include_usage": True}},
            1,
            2,
        ),
    ]:
        before = _scrape(url)
        caplog.clear()
        reply = httpx.post(url + path, json={**body, "max_tokens": 3, "temperature": 1, "ignore_eos": True}, timeout=60)
        assert reply.status_code == 200, reply.text
        if body.get("stream"):
            usage = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")][-1][
                "usage"
            ]
        else:
            usage = reply.json()["usage"]
        after = _scrape(url)
        assert usage["completion_tokens"] == 3 * prompts * n
        logged = next(r.getMessage() for r in caplog.records if "POST" in r.getMessage())
        assert f"prompt={usage['prompt_tokens']} completion={usage['completion_tokens']} " in logged, logged
        read = after["exllama:prompt_tokens_total"] - before.get("exllama:prompt_tokens_total", 0.0)
        made = after["exllama:generation_tokens_total"] - before.get("exllama:generation_tokens_total", 0.0)
        assert (read, made) == (usage["prompt_tokens"], usage["completion_tokens"]), path


def test_a_scored_prompt_counts_nothing_generated(small, caplog):
    import logging

    url = small.url
    caplog.set_level(logging.INFO, logger="exllama_integrations.serve")
    before = _scrape(url)
    body = {"prompt": "The capital of France is Paris", "max_tokens": 0, "echo": True, "logprobs": 1}
    reply = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 0, reply.text
    after = _scrape(url)
    made = after.get("exllama:generation_tokens_total", 0.0) - before.get("exllama:generation_tokens_total", 0.0)
    assert made == 0
    logged = next(r.getMessage() for r in caplog.records if "POST" in r.getMessage())
    assert " completion=0 " in logged, logged


# ------------------------------------------------------------------ defect 8: every encoding JSON allows


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32-le"])
def test_a_body_in_utf16_or_utf32_holds_to_the_same_text_rule(small, encoding):
    url = small.url + "/v1/responses"
    headers = {"content-type": "application/json"}

    def post(body: bytes) -> httpx.Response:
        return httpx.post(url, content=body, headers=headers, timeout=60)

    escaped = '{"input": "Hi", "max_output_tokens": 2, "metadata": {"k": "\\ud800"}, "user": "\\udfff"}'
    reply = post(escaped.encode(encoding))
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_text", reply.text
    codec = "utf-16-le" if encoding == "utf-16" else encoding  # "utf-16" writes a BOM, then little-endian
    unit = "\ud800".encode(codec, "surrogatepass")  # a lone surrogate as the encoding's own code unit
    raw = '{"input": "Hi", "user": "'.encode(encoding) + unit + '"}'.encode(codec)
    reply = post(raw)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_text", reply.text
    fine = post('{"input": "Say \\ud83d\\ude00 or 😀", "max_output_tokens": 2, "user": "Zoë"}'.encode(encoding))
    assert fine.status_code == 200, fine.text


# ------------------------------------------------------------------ defect 10 and the minor list: echo


def test_an_echoed_token_id_prompt_keeps_its_text_and_each_position_its_chosen_token(small, tiny_runtime):
    text = "Café 😀 日本語"
    ids = tiny_runtime.encode(text, add_special_tokens=False)
    body = {"prompt": ids, "echo": True, "max_tokens": 0, "logprobs": 0}
    reply = httpx.post(small.url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["text"] == text
    lp = choice["logprobs"]
    assert lp["top_logprobs"][0] is None  # nothing precedes the first token
    for token, chosen, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert top == {token: chosen}  # logprobs 0: the chosen token alone, as vLLM and OpenAI answer


# ------------------------------------------------------------------ defect 4: a checkpoint's response_template


CONTENT = "{content}"


def _template(open_pattern: str, transform=None) -> dict:
    return {
        "defaults": {"role": "assistant"},
        "start_anchor": "<|im_start|>assistant\n",
        "fields": {
            "tool_calls": {
                "open_pattern": open_pattern,
                "close": "</tool_call>",
                "content": "json",
                "transform": transform or {"type": "function", "function": {"name": "{name}", "arguments": CONTENT}},
            },
            "content": {"content": "text"},
        },
    }


def test_a_response_template_that_backtracks_or_nests_too_deep_is_refused_at_load(caplog):
    from exllama_integrations.chat.formats import response_template_of

    fine = _template(r"\s*<tool_call name=\"(?P<name>[^\"]+)\">")
    assert response_template_of({"response_template": fine}) == fine
    deep: dict = {"x": "{content}"}
    for _ in range(600):
        deep = {"x": deep}
    for spec, why in [
        (_template(r"(\w|\w)*\W\W\W"), "backtracks"),  # the issue's: exponential on a 34-character reply
        (_template(r"(?P<name>(a|aa)+)$"), "backtracks"),
        (_template(r"(?P<name>(.*?,){11}P)"), "backtracks"),  # polynomial, of degree 11
        (_template(r"(?P<name>x)", transform=deep), "nested deeper"),
    ]:
        caplog.clear()
        t0 = time.perf_counter()
        assert response_template_of({"response_template": spec}) is None  # the family table reads the calls
        assert time.perf_counter() - t0 < 2
        assert why in caplog.text and "read by family" in caplog.text


class Held:
    """A runtime whose every generation is held to ``reply`` by a grammar (what the model writes is the test's)."""

    def __init__(self, inner: ExLlamaRuntime, reply: str) -> None:
        from exllama_integrations import Grammar

        self._inner, self._grammar = inner, Grammar.lark("start: " + json.dumps(reply))

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def open(self, request):
        return self._inner.open(dataclasses.replace(request, grammar=self._grammar))

    def aopen(self, request):
        return self._inner.aopen(dataclasses.replace(request, grammar=self._grammar))


def test_a_reply_that_makes_the_templates_regex_backtrack_ends_typed_within_its_budget(tmp_path):
    """A regex that passes the load probes but backtracks on the very reply: bounded by the reply's budget."""
    from servers import ThreadServer
    from tool_families import TOOLS, make_family

    path = make_family("hermes", tmp_path / "slow-parser", seed=3)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["response_template"] = _template(r"(?:xy|x.)*\W\W\W")  # 2^30 ways to read "xy" * 30 before failing
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    rt = ExLlamaRuntime(str(path), "transformers")
    server = ThreadServer(Held(rt, "xy" * 30))
    try:
        assert rt.model_info().details["response_template"] == config["response_template"]  # it passed the probes
        body = {"messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS, "max_tokens": 100}
        t0 = time.perf_counter()
        reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        took = time.perf_counter() - t0
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "chat_template_error", reply.text
        assert "response_template" in reply.json()["error"]["message"] and took < 20
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    finally:
        server.stop()
        rt.close()


# ------------------------------------------------------------------ defect 5: prompt scoring, chunk by chunk


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 1024


def test_a_long_scored_prompt_holds_no_prompt_by_vocabulary_logits_and_reports_progress(engine, tiny_runtime):
    """echo + logprobs with max_tokens 0 on 2560 tokens, in the engine: its logits are reduced chunk by chunk (the
    engine's memory grows by less than 2560 x vocabulary float32), and the watchdog sees progress within the
    prefill (the longest it went without any is well under the whole prefill)."""
    rt, url = engine
    (eng,) = rt.diagnostics()["engines"]
    (pid,) = rt.diagnostics()["engine_pids"]
    text = " ".join(f"item {i} of the list is a word" for i in range(2000))
    ids = tiny_runtime.encode(text, add_special_tokens=False)[:2560]
    vocab = rt.model_info().vocab_size
    base, peak, worst = _rss_mb(pid), 0.0, 0.0
    done: list[httpx.Response] = []
    body = {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0}
    worker = threading.Thread(target=lambda: done.append(httpx.post(url + "/v1/completions", json=body, timeout=300)))
    t0 = time.perf_counter()
    worker.start()
    while worker.is_alive():
        peak, worst = max(peak, _rss_mb(pid)), max(worst, eng.stalled)
        time.sleep(0.05)
    took = time.perf_counter() - t0
    reply = done[0]
    assert reply.status_code == 200, reply.text
    lp = reply.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) and reply.json()["usage"]["completion_tokens"] == 0
    whole = len(ids) * vocab * 4 / 2**20  # what the prompt's logits alone would hold
    print(
        f"scored {len(ids)} ids in {took:.1f} s: engine +{peak - base:.0f} MB (whole logits {whole:.0f} MB), "
        f"longest without progress {worst:.1f} s"
    )
    assert peak - base < whole
    assert worst < 0.6 * took


def test_a_prompt_scored_in_chunks_scores_as_one_forward_does(tiny_runtime, monkeypatch):
    from exllama_integrations.backends import transformers as tb

    text = " ".join(f"line {i}: the quick brown fox" for i in range(200))
    ids = tuple(tiny_runtime.encode(text, add_special_tokens=False)[:700])
    request = GenerationRequest(ids, GenerationSettings(max_new_tokens=3, temperature=0, prompt_logprobs=2))
    chunked = tiny_runtime.generate(request)
    monkeypatch.setattr(tb, "PREFILL_CHUNK", 4096)
    whole = tiny_runtime.generate(request)
    assert chunked.token_ids == whole.token_ids
    assert [lp.token_id for lp in chunked.prompt_logprobs] == [lp.token_id for lp in whole.prompt_logprobs]
    assert [lp.logprob for lp in chunked.prompt_logprobs] == pytest.approx(
        [lp.logprob for lp in whole.prompt_logprobs], abs=1e-4
    )
    assert [[t.token_id for t in lp.top] for lp in chunked.prompt_logprobs] == [
        [t.token_id for t in lp.top] for lp in whole.prompt_logprobs
    ]


# ------------------------------------------------------------------ the minor list: max_tool_calls


def test_max_tool_calls_is_enforced_on_responses(tiny_runtime):
    from servers import ThreadServer

    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "%s"}}</tool_call>'
    server = ThreadServer(Held(tiny_runtime, call % "Paris" + "\n" + call % "Rome"))
    tool = {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
    body = {"input": "Weather in Paris and Rome?", "tools": [tool], "max_output_tokens": 200}
    try:
        for most, cities in [(None, ["Paris", "Rome"]), (1, ["Paris"])]:
            ask = body if most is None else {**body, "max_tool_calls": most}
            reply = httpx.post(server.url + "/v1/responses", json=ask, timeout=120)
            assert reply.status_code == 200, reply.text
            out = reply.json()["output"]
            calls = [json.loads(i["arguments"])["city"] for i in out if i["type"] == "function_call"]
            assert calls == cities, out
            text = "".join(c.get("text", "") for i in out if i["type"] == "message" for c in i["content"])
            assert "tool_call" not in text  # an ignored call is not shown as text either
    finally:
        server.stop()
