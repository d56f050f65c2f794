"""Several models behind one server, as a user runs it: ``exllama-integrations serve --config serve.toml``.

Three models (the demo model, pinned; a tiny random-weight one; the demo model again, unpinned, for requests that
last) and a broken one, under a RAM budget that holds the pinned model and one other: each loads on its first
request (which waits) in an engine process of its own; a third model unloads the least recently used one (its engine
process ends), never the pinned one, never one serving a request (that refusal is a typed 503 saying why);
``keep_alive=0`` unloads a model once its request has ended; requests to two models run at once; a load that fails
is typed and leaves no process behind; the LangChain and LlamaIndex classes reach each model by ``model=``;
``/v1/models``, ``/metrics`` and the log say what happened.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from servers import wait_until_up

pytestmark = pytest.mark.slow

ENGINE_MODULE = "exllama_integrations.runtime.engine.process"
UNLOADED = {name: "unloaded" for name in ("smol", "tiny", "smol-2", "minilm", "broken")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log

    def states(self) -> dict[str, str]:
        return {m["id"]: m["state"] for m in self.cards().values()}

    def cards(self) -> dict[str, dict]:
        return {m["id"]: m for m in httpx.get(self.url + "/v1/models", timeout=30).json()["data"]}

    def engines(self) -> set[int]:
        """The engine processes the server runs now."""
        out = set()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ENGINE_MODULE in cmd and ppid == self.proc.pid:
                out.add(int(entry.name))
        return out

    def complete(self, model: str, **extra) -> httpx.Response:
        body = {"model": model, "prompt": "Hello there", "max_tokens": 3, "temperature": 0, **extra}
        return httpx.post(self.url + "/v1/completions", json=body, timeout=180)

    def wait_for(self, model: str, state: str, seconds: float = 20) -> None:
        t0 = time.monotonic()
        while self.states()[model] != state:
            assert time.monotonic() - t0 < seconds, f"{model} not {state}: {self.states()}"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def server(tmp_path_factory, demo_dir, minilm_dir):
    from arch_models import make_arch

    root = tmp_path_factory.mktemp("multi")
    make_arch("llama3", root / "tiny-dir", seed=1)
    broken = root / "broken-dir"  # passes every check of the directory; its load fails (a tensor is missing)
    shutil.copytree(root / "tiny-dir", broken)
    from safetensors.torch import load_file, save_file

    tensors = load_file(broken / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    (root / "serve.toml").write_text(
        f"""
ram = "1300MiB"      # the pinned model and one other
gpu_memory = 0
keep_alive = "10m"

[[models]]
name = "smol"
model_dir = "{demo_dir}"
backend = "transformers"
pinned = true
ram = "800MiB"

[[models]]
name = "tiny"
model_dir = "tiny-dir"
backend = "transformers"
ram = "400MiB"

[[models]]
name = "smol-2"       # the demo model again: it decodes slowly enough for a request that lasts
model_dir = "{demo_dir}"
backend = "transformers"
ram = "400MiB"

[[models]]
name = "minilm"       # an embedding model: its kind is found from its files
model_dir = "{minilm_dir}"
ram = "100MiB"

[[models]]
name = "broken"
model_dir = "broken-dir"
backend = "transformers"
ram = "100MiB"
"""
    )
    port = _free_port()
    log = root / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "exllama_integrations", "serve", "--config", str(root / "serve.toml")]
            + ["--host", "127.0.0.1", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    s = Server(proc, f"http://127.0.0.1:{port}", log)
    try:
        wait_until_up(s.url, 180, proc)
        yield s
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert not s.engines(), "an engine process outlived its server"


def test_every_model_is_listed_with_its_state(server):
    cards = server.cards()
    assert list(cards) == ["smol", "tiny", "smol-2", "minilm", "broken"]
    assert server.states() == {**UNLOADED, "smol": "loaded"}
    assert cards["minilm"]["kind"] == "embedding" and cards["tiny"]["kind"] == "chat"
    smol = cards["smol"]
    assert smol["pinned"] and smol["keep_alive"] == -1 and smol["kind"] == "chat" and smol["backend"] == "transformers"
    assert smol["memory"]["counted"]["ram_bytes"] == 800 * 2**20  # its entry's figure, not the estimate
    measured, estimate = smol["memory"]["measured"]["ram_bytes"], smol["memory"]["estimate"]["ram_bytes"]
    assert measured <= estimate <= 2 * measured, "the estimate from its files is an upper bound, and not a wild one"
    assert cards["tiny"]["keep_alive"] == 600 and cards["tiny"]["context_length"] == 2048
    assert len(server.engines()) == 1, "only the pinned model is loaded at start"


def test_the_classes_reach_each_model_by_name(server):
    from exllama_integrations import ModelNotFoundError
    from exllama_integrations.langchain import ChatExLlama, ExLlamaLLM
    from exllama_integrations.llama_index import ExLlamaLLM as LlamaIndexLLM

    chat = ChatExLlama(base_url=server.url, model="tiny", max_tokens=3, temperature=0)  # tiny loads: it waits
    assert chat.exllama_runtime.served_model_name == "tiny"
    assert chat.exllama_runtime.model_info().details["model_dir"].endswith("tiny-dir")
    reply = chat.invoke("Hi")
    assert reply.response_metadata["finish_reason"] == "length" and reply.usage_metadata["output_tokens"] == 3
    llm = ExLlamaLLM(base_url=server.url, model="smol", max_tokens=8, temperature=0)
    assert llm.exllama_runtime.served_model_name == "smol"
    text = llm.invoke("The capital of France is")
    direct = server.complete("smol", prompt="The capital of France is", max_tokens=8).json()["choices"][0]["text"]
    assert text == direct and text.strip(), "the class and the OpenAI endpoint ran the same model"
    index = LlamaIndexLLM(base_url=server.url, model="tiny", max_tokens=3, temperature=0)
    assert index.complete("Hi").raw["usage"]["completion_tokens"] == 3
    with pytest.raises(ModelNotFoundError, match="this server serves 'smol', 'tiny', 'smol-2', 'minilm', 'broken'"):
        ChatExLlama(base_url=server.url, model="nope")
    assert server.states()["tiny"] == "loaded" and len(server.engines()) == 2


def test_requests_to_two_models_run_at_once(server):
    spans: dict[str, list[float]] = {}
    first = threading.Event()

    def stream(model: str, tokens: int) -> None:
        body = {"model": model, "prompt": "Once", "max_tokens": tokens, "ignore_eos": True, "stream": True}
        times = []
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=180) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    times.append(time.monotonic())
                    first.set()
        spans[model] = [times[0], times[-1]]

    slow = threading.Thread(target=stream, args=("smol", 48))
    slow.start()
    assert first.wait(60)
    stream("tiny", 8)
    slow.join(120)
    (s0, s1), (t0, t1) = spans["smol"], spans["tiny"]
    assert s0 < t0 and t1 < s1, f"tiny's stream {spans['tiny']} did not run inside smol's {spans['smol']}"


def test_a_third_model_unloads_the_least_recently_used_never_the_pinned(server):
    before = server.engines()
    assert server.complete("smol-2").status_code == 200  # no room for three: tiny (idle, unpinned) makes room
    assert server.states() == {**UNLOADED, "smol": "loaded", "smol-2": "loaded"}
    after = server.engines()
    assert len(after) == 2 and len(before - after) == 1, "tiny's engine process did not end"
    log = server.log.read_text()
    assert "loading 'smol-2' (transformers) for a request" in log and "unloading 'tiny' (least recently used)" in log
    assert "unloaded 'tiny' to make room for 'smol-2'" in log and "loaded 'smol-2' in" in log
    assert "POST '/v1/completions' 200 model='smol-2' prompt=" in log  # each request's line names its model


def test_a_model_serving_a_request_stays_and_the_refusal_says_why(server):
    from exllama_integrations import ModelUnavailableError
    from exllama_integrations.runtime.remote import RemoteRuntime

    body = {"model": "smol-2", "prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=180) as r:
        lines = r.iter_lines()  # kept: an iterator let go of closes the connection, which cancels the request
        next(line for line in lines if line.startswith("data: {"))
        refused = server.complete("tiny")
        assert server.cards()["smol-2"]["in_flight"] == 1
        with pytest.raises(ModelUnavailableError) as typed:
            RemoteRuntime(server.url, model="tiny")  # the native endpoints refuse it typed, the same way
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert error["code"] == "model_unavailable" and error["param"] == "model"
    assert "'smol-2' (loaded, serving 1 request(s)" in error["message"] and "'smol' (pinned" in error["message"]
    assert typed.value.problem == "no_room"
    assert server.states()["smol-2"] == "loaded" and server.states()["tiny"] == "unloaded"


def test_keep_alive_0_unloads_a_model_once_its_request_has_ended(server):
    reply = server.complete("tiny", keep_alive=0)
    assert reply.status_code == 200 and reply.json()["model"] == "tiny"
    server.wait_for("tiny", "unloaded")
    assert server.states() == {**UNLOADED, "smol": "loaded"}
    t0 = time.monotonic()
    while len(server.engines()) != 1:
        assert time.monotonic() - t0 < 20, "an unloaded model's engine process is still running"
        time.sleep(0.05)
    assert "unloaded 'tiny' after 0 s idle (keep_alive)" in server.log.read_text()


def test_an_embedding_model_is_one_more_entry(server):
    import numpy as np

    from exllama_integrations.langchain import ExLlamaEmbeddings
    from exllama_integrations.llama_index import ExLlamaEmbedding

    wrong = server.complete("minilm")
    assert wrong.status_code == 400 and "serves chat models; 'minilm' is of kind 'embedding'" in wrong.text
    assert server.states()["minilm"] == "unloaded", "a request its model cannot serve loaded it"
    body = {"model": "minilm", "input": ["a cat sits on the mat", "stock markets fell"]}
    r = httpx.post(server.url + "/v1/embeddings", json=body, timeout=120)  # loads it: the request waits
    assert r.status_code == 200 and r.json()["model"] == "minilm"
    vectors = [np.array(d["embedding"]) for d in r.json()["data"]]
    assert [v.shape for v in vectors] == [(384,), (384,)] and server.states()["minilm"] == "loaded"
    lc = ExLlamaEmbeddings(base_url=server.url, model="minilm").embed_documents(["a cat sits on the mat"])[0]
    li = ExLlamaEmbedding(base_url=server.url, model="minilm").get_text_embedding("stock markets fell")
    for got, want in ((lc, vectors[0]), (li, vectors[1])):
        got = np.array(got)
        assert got @ want / np.linalg.norm(got) / np.linalg.norm(want) > 0.9999
    chat_model = httpx.post(server.url + "/v1/embeddings", json={**body, "model": "smol"}, timeout=30)
    assert chat_model.status_code == 400 and "'smol' is of kind 'chat'" in chat_model.text


def test_a_load_that_fails_is_typed_and_leaves_nothing(server):
    engines = server.engines()
    reply = server.complete("broken")
    assert reply.status_code == 503
    error = reply.json()["error"]
    assert error["code"] == "model_unavailable" and "could not be loaded" in error["message"]
    assert "weights are missing from 'broken-dir'" in error["message"]
    card = server.cards()["broken"]
    assert card["state"] == "unloaded" and "weights are missing" in card["error"]
    assert server.engines() == engines, "a failed load left a process behind"
    assert server.complete("smol").status_code == 200, "the other models still serve"


def test_refusals_are_typed_before_anything_loads(server):
    missing = server.complete("nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert "this server serves 'smol', 'tiny', 'smol-2', 'minilm', 'broken'" in missing.json()["error"]["message"]
    bad = server.complete("tiny", keep_alive="soon")
    assert bad.status_code == 400 and "keep_alive must be seconds or a duration" in bad.json()["error"]["message"]
    messages = httpx.post(
        server.url + "/v1/messages",
        json={"model": "nope", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
        timeout=30,
    )
    assert messages.status_code == 404 and messages.json()["type"] == "error"  # in Anthropic's shape there
    assert httpx.get(server.url + "/v1/models/nope", timeout=30).status_code == 404
    for stray, status in (
        (httpx.get(server.url + "/v1/completions?model=tiny"), 405),  # as a server of one model answers it
        (httpx.post(server.url + "/v1/nothing", json={}), 404),
    ):
        assert stray.status_code == status  # a request no model's endpoint takes loads no model
    assert server.states()["tiny"] == "unloaded"
    unnamed = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert unnamed.status_code == 200 and unnamed.json()["model"] == "smol", "no model named: the first listed"


def test_metrics_are_per_model_with_what_happened(server):
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", timeout=30).text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]

    def value(name: str, model: str, **labels: str) -> float:
        found = [s.value for s in samples if s.name == name and s.labels == {"model_name": model, **labels}]
        assert len(found) == 1, (name, model, labels)
        return found[0]

    for model in UNLOADED:
        assert value("vllm:num_requests_running", model) == 0
        assert value("exllama:model_loaded", model) == (model in ("smol", "minilm"))
    assert value("exllama:request_rejected_total", "tiny", reason="no_room") >= 1
    assert value("exllama:request_rejected_total", "broken", reason="load_failed") == 1
    assert value("vllm:prefix_cache_queries_total", "smol") > 0
    assert value("exllama:healthy", "broken") == 0 and value("exllama:healthy", "smol") == 1
    [load] = httpx.get(server.url + "/v1/loads", timeout=30).json()["loads"]
    assert load["num_running_reqs"] == 0 and load["max_total_num_tokens"] == 8192  # smol's context, the one loaded
