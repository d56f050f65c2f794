"""One generation as an object: every token's id is kept, also a token that shows no text yet."""

from __future__ import annotations

from exllama_integrations import GenerationSettings
from exllama_integrations.backends.base import TokenStep
from exllama_integrations.runtime.local.run import Run


class _Bytes:
    """Each id is one byte, decoded as UTF-8."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", "replace")


def test_tokens_of_a_split_character_keep_their_ids_and_arrive_as_one_character():
    run = Run(_Bytes(), GenerationSettings(), [65], frozenset({0}), None, "toy")
    euro = list("€".encode())  # three byte tokens, no text until the last
    chunks = []
    for i, t in enumerate([*euro, 0x21]):
        chunks += run.feed(TokenStep((t,), finish="length" if i == 3 else None), 0.1 * i)
    assert [c.token_ids for c in chunks[:-1]] == [(t,) for t in [*euro, 0x21]]  # every id travels
    assert "".join(c.text for c in chunks) == "€!" and all("\ufffd" not in c.text for c in chunks)
    assert run.result is not None and run.result.token_ids == (*euro, 0x21) and run.result.text == "€!"
    assert run.result.usage.completion_tokens == 4 and run.result.finish_reason == "length"


def test_a_stop_id_ends_the_run_uncounted_in_the_text_but_counted_in_usage():
    run = Run(_Bytes(), GenerationSettings(), [65], frozenset({0}), None, "toy")
    chunks = run.feed(TokenStep((0x68, 0x69, 0), finish="stop_token"), 0.0)
    assert "".join(c.text for c in chunks) == "hi" and run.result.token_ids == (0x68, 0x69)
    assert run.result.finish_reason == "eos" and run.result.usage.completion_tokens == 3


def test_steps_that_waited_arrive_as_one_chunk():
    run = Run(_Bytes(), GenerationSettings(), [65], frozenset({0}), None, "toy")
    waiting = [(TokenStep((t,)), 0.0) for t in b"hello"] + [(TokenStep((0x21,), finish="length"), 0.1)]
    chunks = run.feed_all(waiting)
    assert [c.text for c in chunks] == ["hello!", ""] and chunks[0].token_ids == tuple(b"hello!")
    assert chunks[-1].finish_reason == "length" and run.result.text == "hello!"


def _emitted(settings: GenerationSettings, incremental: bool, n: int = 20) -> tuple[list[list], Run]:
    """n one-token steps through ``emit``, the last one final; what the reader's queue received."""
    run = Run(_Bytes(), settings, [65], frozenset({0}), None, "toy")
    puts: list[list] = []
    emit = run.emit_to(puts.append, incremental)
    for i in range(n):
        emit(TokenStep((0x61 + i % 26,), finish="length" if i == n - 1 else None))
    return puts, run


def test_a_whole_completion_reader_is_woken_once_with_every_step_and_its_time():
    eager, _ = _emitted(GenerationSettings(), True)
    assert len(eager) == 20 and all(len(p) == 1 for p in eager)  # a streaming reader: every step
    whole, run = _emitted(GenerationSettings(), False)
    assert len(whole) == 1 and [s for s, _ in whole[0]] == [s for p in eager for s, _ in p]
    times = [t for _, t in whole[0]]
    assert times == sorted(times) and times[0] < times[-1]  # each step keeps when it was made (TTFT stays exact)
    chunks = run.feed_all(whole[0])
    assert run.result.text == "abcdefghijklmnopqrst" and run.result.usage.completion_tokens == 20
    assert chunks[-1].finish_reason == "length"


def test_stop_strings_are_watched_every_few_steps_and_end_the_run_where_they_match():
    puts, run = _emitted(GenerationSettings(stop=["cd"]), False)
    assert [len(p) for p in puts] == [8, 8, 4]  # the reader sees text every WATCH_EVERY steps, to stop early
    run.feed_all(puts[0])
    assert run.result.text == "ab" and run.result.finish_reason == "stop"
    assert run.result.usage.completion_tokens == 4  # counted up to the step that completed the stop string


def test_once_the_backend_says_what_came_from_the_cache_every_chunk_says_it():
    """The first chunks of a reply can already split its prompt into computed and cached tokens (a reply's opening,
    such as the Messages API's ``message_start``, reports it), and the last chunk's usage agrees."""
    run = Run(_Bytes(), GenerationSettings(), [65] * 600, frozenset({0}), None, "toy")
    first = run.feed(TokenStep((0x68,), cached=512), 0.0)
    rest = run.feed_all([(TokenStep((t,)), 0.1) for t in b"ello"] + [(TokenStep((0x21,), finish="length"), 0.2)])
    assert [c.cached_tokens for c in first + rest[:-1]] == [512, 512]
    assert rest[-1].usage.cached_tokens == 512 and rest[-1].cached_tokens == 512
    quiet = Run(_Bytes(), GenerationSettings(), [65], frozenset({0}), None, "toy")  # a backend that never says
    chunks = quiet.feed(TokenStep((0x68,)), 0.0) + quiet.feed(TokenStep((0x69,), finish="length"), 0.1)
    assert [c.cached_tokens for c in chunks] == [None] * 3 and chunks[-1].usage.cached_tokens == 0
