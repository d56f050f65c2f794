"""The runtime end to end on the real demo model (SmolLM2-135M-Instruct) through the CPU backend; what compares the
runtime with itself (a stream with its whole read, threads with one caller, a seed with itself) on SmolLM2's tokenizer
over the tiny random model (``tiny_runtime``), ~20x faster."""

import threading

import pytest

from exllama_integrations import (
    ContextLengthError,
    ExLlamaRuntime,
    InvalidSettingsError,
    RuntimeClosedError,
)

from helpers import loop_ticks

PROMPT = "The capital of France is"


def test_greedy_answer_and_result_fields(demo_runtime: ExLlamaRuntime):
    r = demo_runtime.generate(PROMPT, temperature=0, max_new_tokens=8)
    assert "Paris" in r.text
    assert r.usage.prompt_tokens == len(demo_runtime.encode(PROMPT, add_special_tokens=True))
    assert r.usage.completion_tokens == len(r.token_ids) or r.finish_reason == "eos"
    assert r.finish_reason in ("length", "eos")
    assert r.timings.time_to_first_token and r.timings.time_to_first_token > 0
    assert r.backend == "transformers"


def test_stream_chunks_concatenate_to_generate(tiny_runtime: ExLlamaRuntime):
    s = tiny_runtime.stream(PROMPT, temperature=0, max_new_tokens=24)
    chunks = list(s)
    assert chunks[-1].finish_reason is not None and chunks[-1].usage is not None
    assert len(chunks) > 3
    assert "".join(c.text for c in chunks) == tiny_runtime.generate(PROMPT, temperature=0, max_new_tokens=24).text
    assert s.result is not None and s.result.text == "".join(c.text for c in chunks)


def test_max_new_tokens_is_a_hard_limit(demo_runtime: ExLlamaRuntime):
    r = demo_runtime.generate("Count: 1, 2, 3,", temperature=0, max_new_tokens=5, ignore_eos=True)
    assert r.usage.completion_tokens == 5 and r.finish_reason == "length"


def test_stop_string_is_honoured_and_absent(demo_runtime: ExLlamaRuntime):
    full = demo_runtime.generate(PROMPT, temperature=0, max_new_tokens=30).text
    assert "." in full
    r = demo_runtime.generate(PROMPT, temperature=0, max_new_tokens=30, stop=["."])
    assert r.finish_reason == "stop" and r.stop_string == "."
    assert "." not in r.text and full.startswith(r.text) and r.text


def test_stop_token_id(demo_runtime: ExLlamaRuntime):
    full = demo_runtime.generate(PROMPT, temperature=0, max_new_tokens=10)
    r = demo_runtime.generate(PROMPT, temperature=0, max_new_tokens=10, stop_token_ids=[full.token_ids[1]])
    assert r.finish_reason == "stop" and r.token_ids == full.token_ids[:1]


def test_seed_reproduces_sampling(tiny_runtime: ExLlamaRuntime):
    kw = dict(temperature=1.0, top_p=0.95, max_new_tokens=20, seed=1234, ignore_eos=True)
    a, b = tiny_runtime.generate(PROMPT, **kw), tiny_runtime.generate(PROMPT, **kw)
    c = tiny_runtime.generate(PROMPT, **{**kw, "seed": 99})
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_logprobs(demo_runtime: ExLlamaRuntime):
    r = demo_runtime.generate(PROMPT, temperature=0, max_new_tokens=4, logprobs=3, ignore_eos=True)
    assert r.logprobs is not None and len(r.logprobs) == 4
    for lp, tid in zip(r.logprobs, r.token_ids):
        assert lp.token_id == tid and lp.logprob <= 0 and len(lp.top) == 3
        assert lp.top[0].token_id == tid  # greedy picks the top token
        assert lp.token == demo_runtime.tokenizer.decode([tid], skip_special_tokens=False)  # text travels with it


def test_breaking_out_cancels_and_runtime_keeps_serving(demo_runtime: ExLlamaRuntime):
    s = demo_runtime.stream(PROMPT, temperature=0, max_new_tokens=200, ignore_eos=True)
    next(s)
    s.close()
    before = threading.active_count()
    assert demo_runtime.generate(PROMPT, temperature=0, max_new_tokens=3).text
    assert threading.active_count() <= before


def test_threads_do_not_interfere(tiny_runtime: ExLlamaRuntime):
    prompts = ["One, two,", "The sky is", PROMPT, "Hello, my name is"]
    alone = [tiny_runtime.generate(p, temperature=0, max_new_tokens=8).text for p in prompts]
    assert len(set(alone)) == 4  # four different answers: one mixed up with another would show
    out: dict[int, str] = {}
    threads = [
        threading.Thread(
            target=lambda i=i: out.__setitem__(
                i, tiny_runtime.generate(prompts[i], temperature=0, max_new_tokens=8).text
            )
        )
        for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [out[i] for i in range(4)] == alone


def test_batch_validates_once_and_matches(demo_runtime: ExLlamaRuntime):
    prompts = ["One, two,", "The sky is"]
    assert [r.text for r in demo_runtime.batch(prompts, temperature=0, max_new_tokens=6)] == [
        demo_runtime.generate(p, temperature=0, max_new_tokens=6).text for p in prompts
    ]
    with pytest.raises(InvalidSettingsError):
        demo_runtime.batch(prompts, temperature=-1)


def test_prompt_longer_than_context(demo_runtime: ExLlamaRuntime, demo_dir):
    long = "word " * (demo_runtime.context_length + 10)
    with pytest.raises(ContextLengthError, match="context is 8192"):
        demo_runtime.generate(long, max_new_tokens=4)
    # the cut itself on a 512-token context: the same code, without an 8,190-token prefill on CPU (76 s in CI)
    small = ExLlamaRuntime(demo_dir, backend="transformers", max_seq_len=512)
    try:
        with pytest.raises(ContextLengthError, match="context is 512"):
            small.generate("word " * 600, max_new_tokens=4)
        r = small.generate("word " * 600, max_new_tokens=2, truncate_prompt=True, temperature=0)
        assert r.usage.prompt_tokens == small.context_length - 2 == 510
    finally:
        small.close()


@pytest.mark.parametrize(
    ("prompt", "match"),
    [("", "empty"), ("bad \udcff surrogate", "UTF-8"), (b"bytes", "bytes"), ([], "no tokens"), ([10**9], "token ids")],
)
def test_bad_prompts(demo_runtime: ExLlamaRuntime, prompt, match):
    with pytest.raises(InvalidSettingsError, match=match):
        demo_runtime.generate(prompt)
    assert demo_runtime.generate(PROMPT, temperature=0, max_new_tokens=2).text  # still usable


def test_unknown_setting(demo_runtime: ExLlamaRuntime):
    with pytest.raises(InvalidSettingsError, match="unknown generation setting"):
        demo_runtime.generate(PROMPT, temprature=0)


def test_registry_shares_and_close_frees(demo_dir):
    a = ExLlamaRuntime.shared(demo_dir, backend="transformers", max_seq_len=512)
    b = ExLlamaRuntime.shared(str(demo_dir) + "/", backend="transformers", max_seq_len=512)
    c = ExLlamaRuntime.shared(demo_dir, backend="transformers", max_seq_len=256)
    assert a is b and a is not c
    assert a in ExLlamaRuntime.loaded()
    a.close()
    assert a.closed and a not in ExLlamaRuntime.loaded()
    with pytest.raises(RuntimeClosedError, match="closed"):
        a.generate(PROMPT)
    d = ExLlamaRuntime.shared(demo_dir, backend="transformers", max_seq_len=512)
    assert d is not a and d.generate(PROMPT, temperature=0, max_new_tokens=2).text
    d.close()
    c.close()


async def test_astream_keeps_the_event_loop_free(demo_runtime: ExLlamaRuntime):

    async with loop_ticks() as ticks:
        text = "".join(
            [c.text async for c in demo_runtime.astream(PROMPT, temperature=0, max_new_tokens=20, ignore_eos=True)]
        )
    assert text
    ticks.assert_free()  # ~0.6 s of decoding; a blocked loop would tick once


def test_a_whole_completion_read_gives_the_same_chunks_result_and_timings(demo_runtime: ExLlamaRuntime):
    kw = dict(temperature=0, max_new_tokens=24, ignore_eos=True)
    live = demo_runtime.stream(PROMPT, **kw)
    live_chunks = list(live)
    whole = demo_runtime.stream(PROMPT, incremental=False, **kw)
    whole_chunks = list(whole)
    assert "".join(c.text for c in whole_chunks) == "".join(c.text for c in live_chunks) == whole.result.text
    assert whole.result.token_ids == live.result.token_ids and whole.result.usage == live.result.usage
    assert len(whole_chunks) <= 3 < len(live_chunks)  # handed over at the end: the first token, the rest, the end
    t = whole.result.timings
    assert 0 < t.time_to_first_token < t.total and t.tokens_per_second > 0
    stopped = demo_runtime.generate(PROMPT, temperature=0, max_new_tokens=60, stop=["."])
    streamed = demo_runtime.stream(PROMPT, temperature=0, max_new_tokens=60, stop=["."])
    list(streamed)
    assert stopped.text == streamed.result.text and stopped.finish_reason == "stop"
    assert stopped.usage.completion_tokens == streamed.result.usage.completion_tokens  # cut where the stream was
