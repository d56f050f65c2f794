"""The engine process (``engine="process"``, ``serve --engine process``) end to end.

On SmolLM2's tokenizer over a tiny random model (tests/fixture_models.py): every check compares the engine with the
thread, or watches processes, so no trained model is needed, and an engine loads and decodes ~20x faster. Streams
that must still run when a test acts on them (close, kill) ask for thousands of tokens, as the tiny model never
stops by itself and writes them fast.

The same requests must give the same results as the backend in a thread (greedy text, streaming pieces,
grammar verdicts, logprobs, reasoning counts, images); a cancelled stream frees the engine; killing the engine
mid-stream ends every open stream with a typed error within 5 s, /health says so, and a new engine serves
again; an engine never outlives its parent or leaves a file; two engines share the load and a follow-up turn
goes to the engine that holds its prefix.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest

from exllama_integrations import (
    EngineUnavailableError,
    ExLlamaRuntime,
    GenerationRequest,
    GenerationSettings,
    Grammar,
    ModelLoadError,
)
from exllama_integrations.runtime.engine import PrefixRouter, block_hashes

pytestmark = pytest.mark.slow

ENGINE_MODULE = "exllama_integrations.runtime.engine.process"


def engine_pids() -> set[int]:
    """Engine processes whose parent is this test process."""
    out = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ENGINE_MODULE in cmd and ppid == os.getpid():
            out.add(int(entry.name))
    return out


def engine_dirs() -> set[str]:
    import tempfile

    return {p.name for p in Path(tempfile.gettempdir()).glob("exllama-engine-*")}


@pytest.fixture(scope="module")
def proc_rt(tiny_dir: Path):
    rt = ExLlamaRuntime(tiny_dir, "transformers", engine="process")
    yield rt
    rt.close()


def greedy(n: int = 12, **kw) -> GenerationSettings:
    return GenerationSettings(max_new_tokens=n, temperature=0, **kw)


def test_the_engine_process_answers_as_the_thread_does(proc_rt, tiny_runtime):
    assert proc_rt.engine == "process" and tiny_runtime.engine == "thread"
    assert proc_rt.model_info().details["engine_pids"][0] in engine_pids()
    assert proc_rt.model_info().context_length == tiny_runtime.model_info().context_length
    for prompt in ("The capital of France is", "def fibonacci(n):"):
        ours = proc_rt.generate(prompt, settings=greedy(logprobs=2))
        ref = tiny_runtime.generate(prompt, settings=greedy(logprobs=2))
        assert ours.text == ref.text and ours.text.strip()
        assert ours.token_ids == ref.token_ids
        assert ours.usage == ref.usage and ours.finish_reason == ref.finish_reason
        assert [lp.token_id for lp in ours.logprobs] == [lp.token_id for lp in ref.logprobs]
        assert [round(lp.logprob, 3) for lp in ours.logprobs] == [round(lp.logprob, 3) for lp in ref.logprobs]
        pieces = [c.text for c in proc_rt.stream(prompt, settings=greedy())]
        assert len([p for p in pieces if p]) > 3 and "".join(pieces) == ref.text
    chat = ({"role": "user", "content": "Name a colour."},)
    stop = tiny_runtime.generate(GenerationRequest(messages=chat, settings=greedy())).text.split()[2]  # in the reply
    ours = proc_rt.generate(GenerationRequest(messages=chat, settings=greedy(stop=[stop])))
    ref = tiny_runtime.generate(GenerationRequest(messages=chat, settings=greedy(stop=[stop])))
    assert (ours.text, ours.finish_reason, ours.stop_string) == (ref.text, ref.finish_reason, ref.stop_string)
    assert ref.stop_string == stop and ref.finish_reason == "stop"


def test_grammar_and_reasoning_run_in_the_engine_and_report_back(proc_rt, tiny_runtime):
    grammar = Grammar.regex("(yes|no), because [a-z ]{5,20}")
    ours = proc_rt.generate(GenerationRequest("Is the sky blue? Answer:", settings=greedy(24), grammar=grammar))
    ref = tiny_runtime.generate(GenerationRequest("Is the sky blue? Answer:", settings=greedy(24), grammar=grammar))
    assert ours.text == ref.text and ours.text.split(",")[0] in ("yes", "no")
    assert ours.constraint_complete == ref.constraint_complete is True
    short = proc_rt.generate(GenerationRequest("Is the sky blue? Answer:", settings=greedy(3), grammar=grammar))
    assert short.constraint_complete is False  # cut by max_new_tokens: the engine's matcher said so
    thinking = GenerationRequest(
        "Think first.", settings=greedy(20, max_reasoning_tokens=5), reasoning=Reasoning_started()
    )
    ours, ref = proc_rt.generate(thinking), tiny_runtime.generate(thinking)
    end = len(tiny_runtime.encode("</think>"))
    assert ours.usage.reasoning_tokens == ref.usage.reasoning_tokens == 5 + end  # the budget, then the forced end
    assert ours.reasoning == ref.reasoning and ours.text == ref.text


def Reasoning_started():  # noqa: N802 - a tiny factory, named as what it makes
    from exllama_integrations import Reasoning

    return Reasoning("<think>", "</think>", started=True)


def test_a_closed_stream_frees_the_engine_at_once(proc_rt):
    (engine,) = proc_rt.diagnostics()["engines"]  # what the engine still holds for us
    stream = proc_rt.stream("Once upon a time", settings=greedy(4000, ignore_eos=True))
    next(iter(stream))
    assert engine.load == 1
    t0 = time.perf_counter()
    stream.close()
    while engine.load and time.perf_counter() - t0 < 5:
        time.sleep(0.01)
    assert engine.load == 0
    assert proc_rt.generate("Hi", settings=greedy(2)).usage.completion_tokens == 2


def test_killing_the_engine_ends_streams_typed_health_says_so_and_it_serves_again(tiny_dir):
    from servers import ThreadServer

    rt = ExLlamaRuntime(tiny_dir, "transformers", engine="process")
    server = ThreadServer(rt)
    try:
        assert httpx.get(server.url + "/health").json()["status"] == "ok"
        streams = [rt.stream(f"Story {i}: once upon a time", settings=greedy(4000, ignore_eos=True)) for i in range(2)]
        outcomes: list[BaseException | None] = [None, None]
        ended = [0.0, 0.0]

        def read(i: int) -> None:
            try:
                for _ in streams[i]:
                    pass
            except BaseException as e:  # noqa: BLE001 - what the reader sees is the point
                outcomes[i] = e
            ended[i] = time.perf_counter()

        readers = [threading.Thread(target=read, args=(i,)) for i in range(2)]
        for t in readers:
            t.start()
        time.sleep(1.0)
        (pid,) = rt.model_info().details["engine_pids"]
        killed = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        for t in readers:
            t.join(10)
        assert all(isinstance(e, EngineUnavailableError) for e in outcomes), outcomes
        assert max(ended) - killed < 5
        assert "SIGKILL" in str(outcomes[0])
        health = httpx.get(server.url + "/health")
        if health.status_code == 503:  # caught while the new engine loads
            assert health.json()["status"] == "unavailable" and "SIGKILL" in health.json()["reason"]
            with pytest.raises(EngineUnavailableError):
                rt.generate("Hi", settings=greedy(2))
        t0 = time.perf_counter()
        while httpx.get(server.url + "/health").status_code != 200 and time.perf_counter() - t0 < 120:
            time.sleep(0.2)
        assert httpx.get(server.url + "/health").json()["status"] == "ok"
        reply = httpx.post(
            server.url + "/v1/completions",
            json={"model": rt.model_name, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
            timeout=60,
        )
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"].strip()
        assert pid not in engine_pids() and len(engine_pids() & set(rt.diagnostics()["engine_pids"])) == 1
    finally:
        server.stop()
        rt.close()


def test_the_health_of_a_dead_engine_is_visible_while_it_restarts(tiny_dir, monkeypatch):
    from servers import ThreadServer

    from exllama_integrations.runtime.engine import client

    rt = ExLlamaRuntime(tiny_dir, "transformers", engine="process")
    server = ThreadServer(rt)
    started = threading.Event()
    real_start = client.EngineProcess._start

    def slow_start(self):  # the second start waits, so the 503 is seen for sure
        started.set()
        time.sleep(2)
        real_start(self)

    try:
        monkeypatch.setattr(client.EngineProcess, "_start", slow_start)
        os.kill(rt.diagnostics()["engine_pids"][0], signal.SIGKILL)
        assert started.wait(5)
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and "SIGKILL" in health.json()["reason"]
        from prometheus_client.parser import text_string_to_metric_families

        scraped = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
        assert [s.value for s in scraped["exllama:healthy"].samples] == [0.0]
        reply = httpx.post(
            server.url + "/v1/completions", json={"model": rt.model_name, "prompt": "Hi", "max_tokens": 2}
        )
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "engine_unavailable"
    finally:
        server.stop()
        rt.close()


def test_closing_while_the_engine_starts_again_leaves_no_engine(tiny_dir, monkeypatch):
    from exllama_integrations.runtime.engine import client

    before = engine_pids()
    rt = ExLlamaRuntime(tiny_dir, "transformers", engine="process")
    (engine,) = rt.diagnostics()["engines"]
    real_start = client.EngineProcess._start
    restarting, restarted = threading.Event(), threading.Event()

    def slow_start(self):  # the new engine starts only after the runtime was closed
        restarting.set()
        time.sleep(1)
        try:
            real_start(self)
        finally:
            restarted.set()

    monkeypatch.setattr(client.EngineProcess, "_start", slow_start)
    os.kill(rt.diagnostics()["engine_pids"][0], signal.SIGKILL)
    assert restarting.wait(5)
    rt.close()
    assert restarted.wait(60)  # the new engine loaded (or failed to): now it must go away at once
    t0 = time.perf_counter()
    while (engine.pid is not None or engine_pids() - before) and time.perf_counter() - t0 < 10:
        time.sleep(0.2)
    assert engine.pid is None and engine_pids() <= before


def test_load_errors_arrive_typed_and_nothing_stays_running(tiny_dir, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    (broken / "model.safetensors").write_bytes(b"\0" * 64)  # the header is gone: the engine cannot load it
    before_dirs, before_pids = engine_dirs(), engine_pids()
    with pytest.raises(ModelLoadError) as err:
        ExLlamaRuntime(broken, "transformers", engine="process")
    assert "safetensors" in str(err.value).lower() or "load" in str(err.value).lower()
    assert engine_pids() <= before_pids
    assert engine_dirs() <= before_dirs


def test_an_engine_never_outlives_its_parent(tiny_dir):
    script = textwrap.dedent(
        f"""
        import sys, time
        from exllama_integrations import ExLlamaRuntime
        rt = ExLlamaRuntime({str(tiny_dir)!r}, "transformers", engine="process")
        print(rt.model_info().details["engine_pids"][0], flush=True)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        t0 = time.perf_counter()
        while _alive(pid) and time.perf_counter() - t0 < 10:
            time.sleep(0.05)
        assert not _alive(pid) and time.perf_counter() - t0 < 5
    finally:
        parent.kill()


def test_close_leaves_no_process_and_no_file(tiny_dir):
    before, before_pids = engine_dirs(), engine_pids()
    rt = ExLlamaRuntime(tiny_dir, "transformers", engine="process")
    assert len(engine_dirs() - before) == 1 and len(engine_pids() - before_pids) == 1
    stream = rt.stream("Once upon a time", settings=greedy(4000, ignore_eos=True))
    next(iter(stream))
    t0 = time.perf_counter()
    rt.close()
    assert time.perf_counter() - t0 < 10
    assert [c.finish_reason for c in stream][-1:] in (["cancelled"], [])
    assert engine_dirs() <= before and engine_pids() <= before_pids


def test_two_engines_share_the_load_and_a_follow_up_goes_where_its_prefix_is(tiny_dir):
    rt = ExLlamaRuntime(tiny_dir, "transformers", engines=2)
    try:
        assert rt.engine == "process" and len(set(rt.model_info().details["engine_pids"])) == 2
        engines = rt.diagnostics()["engines"]
        streams = [rt.stream(f"Tale {i}: once", settings=greedy(2000, ignore_eos=True)) for i in range(2)]
        for s in streams:
            next(iter(s))
        assert [e.load for e in engines] == [1, 1]  # spread, not queued on one
        for s in streams:
            s.close()
        conversation = "A long conversation. " * 120  # more than one block of 256 tokens
        assert len(rt.encode(conversation)) > 256
        first = rt.stream(conversation, settings=greedy(2000, ignore_eos=True))
        next(iter(first))
        home = [e.load for e in engines].index(1)
        # the home engine is busier now, the other idle: a fresh prompt goes to the idle one, the follow-up home
        fresh = rt.stream("Something else entirely.", settings=greedy(2000, ignore_eos=True))
        next(iter(fresh))
        assert engines[1 - home].load == 1
        follow = rt.stream(conversation + " And then?", settings=greedy(2000, ignore_eos=True))
        next(iter(follow))
        assert engines[home].load == 2 and engines[1 - home].load == 1
        for s in (first, fresh, follow):
            s.close()
        _until_idle(engines)
        rt.expect(4)  # a LangChain batch announces itself, then its members arrive one by one: spread by load
        members = [rt.stream(f"Member {i}: once", settings=greedy(2000, ignore_eos=True)) for i in range(4)]
        assert [e.load for e in engines] == [2, 2]
        for m in members:
            m.close()
        results = rt.batch([f"Question {i}:" for i in range(4)], settings=greedy(3))
        assert all(r.usage.completion_tokens == 3 for r in results)
        _until_idle(engines, 20)
        for k in range(2):  # a batch handed in whole (ExLlamaLLM.batch) is spread evenly too, not as chance falls
            whole = rt.open_batch([rt.request(f"Batch {k}-{i}: once", greedy(2000, ignore_eos=True)) for i in range(8)])
            assert [e.load for e in engines] == [4, 4]
            for s in whole:
                s.close()
            _until_idle(engines, 20)
    finally:
        rt.close()


def _until_idle(engines, seconds: float = 10) -> None:
    """Wait (at most ``seconds``) until no engine holds a request: closed streams leave them a step later."""
    t0 = time.perf_counter()
    while any(e.load for e in engines) and time.perf_counter() - t0 < seconds:
        time.sleep(0.01)


def test_without_pyzmq_the_engine_process_names_its_extra(tiny_dir):
    code = (
        "import sys; sys.modules['zmq'] = None\n"
        "from exllama_integrations import ExLlamaRuntime, MissingDependencyError\n"
        f"try:\n    ExLlamaRuntime({str(tiny_dir)!r}, 'transformers', engine='process')\n"
        "except MissingDependencyError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert "exllama-integrations[engine]" in out


def test_the_framework_classes_take_engine_process(tiny_dir, tiny_runtime):
    from llama_index.core.llms import ChatMessage

    from exllama_integrations.langchain import ChatExLlama
    from exllama_integrations.llama_index import ExLlamaLLM as LlamaIndexLLM

    kw = {"model_dir": str(tiny_dir), "backend": "transformers", "temperature": 0, "max_new_tokens": 8}
    chat = ChatExLlama(**kw, engine="process")
    assert chat.exllama_runtime.engine == "process" and chat.exllama_runtime is not tiny_runtime
    question = "What is the capital of France?"
    reference = ChatExLlama(**kw).invoke(question).content
    assert chat.invoke(question).content == reference and reference.strip()
    li = LlamaIndexLLM(**kw, engine="process")
    assert li.exllama_runtime is chat.exllama_runtime  # one shared engine for both frameworks
    assert li.chat([ChatMessage(role="user", content=question)]).message.content == reference


def test_the_router_prefers_the_prefix_unless_that_engine_is_much_busier():
    router = PrefixRouter(2, block=4)  # the default slack: 4 requests, as docs/serving.md says
    convo = list(range(40))
    assert block_hashes(convo, 4)[:3] == block_hashes(convo[:12], 4)
    assert block_hashes([1, 2, 3], 4) == []
    home = router.choose(convo, [0, 0], [True, True])
    assert router.choose(convo + [99], [0, 1] if home == 0 else [1, 0], [True, True]) == home  # busier by 1: home
    assert router.choose(convo + [98], [4, 0] if home == 0 else [0, 4], [True, True]) == home  # by 4: still home
    busy = [5, 0] if home == 0 else [0, 5]
    assert router.choose(convo + [7], busy, [True, True]) != home  # busier by more than the slack: elsewhere
    assert router.choose(list(range(100, 140)), [3, 1], [True, True]) == 1  # fresh prompt: least loaded
    assert router.choose(convo, [0, 0], [home != 0, home != 1]) != home  # home down: the other
    assert router.choose(convo, [0, 0], [False, False]) == -1


def test_serve_runs_its_model_in_an_engine_process_by_default(tiny_dir):
    from exllama_integrations.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    port_cmd = [sys.executable, "-m", "exllama_integrations", "serve", str(tiny_dir), "--backend", "transformers"]
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([*port_cmd, "--port", str(port)], stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 120:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        children = [
            int(p.name)
            for p in Path("/proc").iterdir()
            if p.name.isdigit() and _ppid(p) == proc.pid and ENGINE_MODULE in _cmd(p)
        ]
        assert len(children) == 1
        reply = httpx.post(
            url + "/v1/completions",
            json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
            timeout=60,
        )
        assert reply.json()["choices"][0]["text"].strip()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        time.sleep(0.5)
        assert not Path(f"/proc/{children[0]}").exists()
    finally:
        proc.kill()


def _ppid(p: Path) -> int:
    try:
        return int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _cmd(p: Path) -> str:
    try:
        return (p / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    """Whether a process runs (a zombie, dead but not yet collected by its dead parent's reaper, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
