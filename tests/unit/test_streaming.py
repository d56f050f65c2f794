"""Detokenizer and stop matcher, with property tests over real tokenizers."""

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exllama_integrations.model.detokenizer import IncrementalDetokenizer, StopStringMatcher
from exllama_integrations.model.tokenizer import NativeTokenizer


def feed_all(detok: IncrementalDetokenizer, ids: list[int], cuts: list[int]) -> str:
    out, pos = [], 0
    for c in sorted(set(cuts)) + [len(ids)]:
        out.append(detok.add(ids[pos:c]))
        pos = c
    out.append(detok.flush())
    return "".join(out)


# ---------------------------------------------------------------- detokenizer


@pytest.fixture(scope="module")
def smol(demo_dir: Path) -> NativeTokenizer:
    return NativeTokenizer.from_model_dir(str(demo_dir))


@pytest.fixture(scope="module")
def sp_tok(tmp_path_factory: pytest.TempPathFactory) -> NativeTokenizer:
    """A real sentencepiece model with byte fallback, trained here on a few lines."""
    import json

    import sentencepiece as spm

    d = tmp_path_factory.mktemp("sp")
    text = d / "corpus.txt"
    text.write_text(
        "\n".join(
            [
                "The quick brown fox jumps over the lazy dog.",
                "Ça coûte 12€ à Paris, n'est-ce pas?",
                "日本語のテキストも少しあります。",
                "Hello world, hello tokenizer!",
            ]
            * 50
        ),
        encoding="utf-8",
    )
    spm.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(d / "tokenizer"),
        vocab_size=400,
        byte_fallback=True,
        character_coverage=0.99,
        model_type="bpe",
        bos_id=1,
        eos_id=2,
        unk_id=0,
        pad_id=-1,
    )
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "bos_token_id": 1, "eos_token_id": 2}))
    import numpy as np
    from safetensors.numpy import save_file

    save_file({"x": np.zeros(1, dtype=np.float32)}, str(d / "model.safetensors"))
    return NativeTokenizer.from_model_dir(str(d))


TEXTS = [
    "Hello world",
    "  leading spaces",
    "multi-byte: é, ü, 日本語, emoji 🦙🚀",
    "tabs\tand\nnewlines\n\n",
    "digits 1234567890",
    "Ça coûte 12€ à Paris",
]


@pytest.mark.parametrize("text", TEXTS)
def test_detok_token_by_token_equals_decode_bytelevel(smol: NativeTokenizer, text: str) -> None:
    ids = smol.encode(text)
    d = IncrementalDetokenizer(smol)
    pieces = [d.add([i]) for i in ids] + [d.flush()]
    assert "".join(pieces) == smol.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)  # a split multi-byte character is held back, not garbled


@pytest.mark.parametrize("text", TEXTS)
def test_detok_sentencepiece_leading_spaces_and_byte_fallback(sp_tok: NativeTokenizer, text: str) -> None:
    ids = sp_tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(sp_tok)
    pieces = [d.add([i]) for i in ids] + [d.flush()]
    assert "".join(pieces) == sp_tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_detok_keeps_a_lone_space_piece_at_any_chunk_boundary(sp_tok: NativeTokenizer) -> None:
    """Sentencepiece strips all leading whitespace of what it decodes: a window opening on a lone "▁" lost a space."""
    import itertools

    hello, world = sp_tok.encode("Hello", add_special_tokens=False), sp_tok.encode("world", add_special_tokens=False)
    spaces = [i for i in range(sp_tok.vocab_size) if sp_tok.decode([*hello, i]) == sp_tok.decode(hello) + " "]
    lone = [i for i in spaces if sp_tok.decode([i]) == ""]  # the "▁" piece (the byte-fallback space shows itself)
    assert lone, "the fixture tokenizer has no lone space piece"
    for ids in ([*hello, lone[0], *world], [*hello, lone[0], lone[0], lone[0], *world]):
        for r in range(len(ids)):
            for cuts in itertools.combinations(range(1, len(ids)), r):
                assert feed_all(IncrementalDetokenizer(sp_tok), ids, list(cuts)) == sp_tok.decode(ids), cuts


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_detok_any_token_sequence_equals_full_decode(smol: NativeTokenizer, sp_tok: NativeTokenizer, data) -> None:
    tok = data.draw(st.sampled_from([smol, sp_tok]))
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=40))
    cuts = data.draw(st.lists(st.integers(0, len(ids)), max_size=10))
    assert feed_all(IncrementalDetokenizer(tok), ids, cuts) == tok.decode(ids)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=60))
def test_detok_roundtrips_any_text(smol: NativeTokenizer, text: str) -> None:
    ids = smol.encode(text)
    d = IncrementalDetokenizer(smol)
    assert "".join(d.add([i]) for i in ids) + d.flush() == smol.decode(ids)


# ---------------------------------------------------------------- stop matcher


def run_matcher(stops: list[str], chunks: list[str]) -> tuple[str, str | None]:
    m = StopStringMatcher(stops)
    out = "".join(m.push(c) for c in chunks)
    if m.stopped is None:
        out += m.flush()
    return out, m.stopped


def reference(stops: list[str], text: str) -> tuple[str, str | None]:
    """Character-by-character definition: stop where a stop string first completes."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if s and text[:end].endswith(s)]
        if hits:
            s = max(hits, key=len)
            return text[: end - len(s)], s
    return text, None


def test_stop_split_across_chunks():
    assert run_matcher(["</s>"], ["Hello <", "/", "s> more"]) == ("Hello ", "</s>")


def test_stop_at_the_very_start():
    assert run_matcher(["###"], ["###", "tail"]) == ("", "###")


def test_overlapping_stops_first_completed_wins():
    assert run_matcher(["abcd", "bc"], ["a", "b", "c", "d"]) == ("a", "bc")
    assert run_matcher(["abcd", "bc"], ["abcd"]) == ("a", "bc")  # same answer however it is chunked


def test_partial_stop_held_then_released():
    m = StopStringMatcher(["STOP"])
    assert m.push("go ST") == "go "
    assert m.held == "ST"
    assert m.push("ART") == "START"
    assert m.flush() == ""


def test_no_stops_passes_through():
    assert run_matcher([], ["a", "b"]) == ("ab", None)


@settings(max_examples=3000, deadline=None)
@given(
    stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), max_size=4),
    text=st.text(alphabet="abcd\n", max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=8),
)
def test_matcher_never_emits_a_stop_and_never_loses_text(stops, text, cuts):
    pos, chunks = 0, []
    for c in sorted(set(min(c, len(text)) for c in cuts)) + [len(text)]:
        chunks.append(text[pos:c])
        pos = c
    out, stopped = run_matcher(stops, chunks)
    want_out, want_stop = reference(stops, text)
    assert (out, stopped is not None) == (want_out, want_stop is not None)
    assert not any(s in out for s in stops)
    assert text.startswith(out)
    if stopped is None:
        assert out == text


class _Bytes:
    """A byte tokenizer: each id is one byte, decoded as UTF-8 with replacement."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", "replace")


def test_a_run_of_invalid_bytes_streams_in_linear_time():
    import time

    ids = [0x80] * 4000 + list(b"done")  # lone continuation bytes: never a character
    d = IncrementalDetokenizer(_Bytes())
    t0 = time.perf_counter()
    pieces = [d.add([i]) for i in ids]
    elapsed = time.perf_counter() - t0
    assert "".join(pieces) + d.flush() == _Bytes().decode(ids)
    shown = 0
    for n, p in enumerate(pieces[:4000], 1):  # each lone byte is one replacement character
        shown += len(p)
        assert n - shown <= 9, f"{n - shown} tokens held back after {n}: the text is not shown as it comes"
    assert elapsed < 0.5, f"{elapsed:.2f}s for 4000 tokens: the held window grows"


@settings(max_examples=500, deadline=None)
@given(
    ids=st.lists(st.sampled_from([0x80, 0xBF, 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0xA6, 0x99, 0x41]), max_size=60)
)
def test_detok_of_any_byte_soup_equals_full_decode(ids):
    cuts = list(range(0, len(ids), 3))
    assert feed_all(IncrementalDetokenizer(_Bytes()), ids, cuts) == _Bytes().decode(ids)
    d = IncrementalDetokenizer(_Bytes())
    assert "".join(d.add([i]) for i in ids) + d.flush() == _Bytes().decode(ids)
