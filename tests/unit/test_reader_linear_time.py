"""Reading a model's reply costs time linear in its length, in EVERY format of the table (issue 54).

A reply is model output: a repetition loop cut by ``max_tokens`` is a few thousand tokens of the same markup, and
the reader runs where the server must stay responsive. For every entry of ``chat.formats.FORMATS`` and four kinds
of reply (well-formed calls one after another; calls whose closes are all missing; a call cut in a loop of its own
middle, as a repetition loop writes it; a call with long runs of spaces after its open, between two arguments and
before its close), reading twice the text must cost at most ~2.5 times the time: read whole (:func:`read_reply`)
and streamed in chunks (the :class:`ReplyReader` and the :class:`CallProgress` a stream runs, what a cut call keeps
as its arguments included).

Measured as a ratio in one run (CPU time of this process, garbage collection off, the median of a few
interleaved repetitions, measured up to three times before failing), so a busy machine slows both sizes alike.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable

import pytest

from exllama_integrations.chat.formats import FORMATS, CallProgress, ReplyReader, partial_object, read_reply
from exllama_integrations.chat.formats.grammar import write_calls

SIZE = 20_000
"""Characters of the smaller reply (the larger is twice as long)."""
RATIO = 2.5
REPEATS = 3
ROUNDS = 3
"""Measurements before a ratio over ``RATIO`` fails (the readers this replaced measured x3 to x5 every time)."""
CHUNK = 48
"""Characters a streamed piece (a few tokens)."""

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "array", "items": {"type": "string"}},
                "n": {"type": "integer"},
            },
        },
    },
}
ARGS = {"city": "Paris", "days": ["mon", "tue"], "n": 3}


def _replies(name: str) -> dict[str, Callable[[int], str]]:
    """Each kind of reply of this format, as a function of its length."""
    fmt = FORMATS[name]
    call = write_calls(fmt, [("get_weather", ARGS)])
    unclosed = call
    for close in (*fmt.closes, fmt.after, *_closing_tags(call)):
        unclosed = unclosed.replace(close, "") if close.strip() else unclosed
    head, middle = call[: len(call) // 2], call[len(call) // 4 : len(call) // 2]
    # spaces right after the call's open, in its middle and right before its close (or its end)
    opened = next((call.find(o) + len(o) for o in fmt.opens if o in call), 0)
    closed = min([call.find(c) for c in fmt.closes if c in call] or [len(call)])
    middle_at = call.find(",", (opened + closed) // 2) + 1 or (opened + closed) // 2  # (between two arguments)

    def repeat(start: str, unit: str) -> Callable[[int], str]:
        return lambda n: start + unit * max(1, (n - len(start)) // len(unit))

    return {
        "well-formed": repeat("", call + fmt.between),
        "unclosed": repeat("", unclosed),
        "repetitive": repeat(head, middle),
        "spaces": lambda n: (" " * (n // 3)).join(
            [call[:opened], call[opened:middle_at], call[middle_at:closed], call[closed:]]
        ),
    }


def _closing_tags(text: str) -> list[str]:
    """Every ``</...>`` and ``...|>``-shaped close in a call text (its parameters' and its own)."""
    out, at = [], text.find("</")
    while at >= 0:
        end = text.find(">", at)
        if end < 0:
            break
        out.append(text[at : end + 1])
        at = text.find("</", end)
    return out


def _read(name: str, text: str) -> None:
    fmt = FORMATS[name]
    read_reply(fmt, text, [TOOL])
    reader, progress = ReplyReader(fmt, [TOOL]), CallProgress(fmt, [TOOL])
    for i in range(0, len(text), CHUNK):
        reader.feed(text[i : i + CHUNK])
        progress.feed(text[i : i + CHUNK])
    reader.finish(cut=True)
    for call in progress.calls:
        partial_object(call.arguments)


def _ratio(name: str, make: Callable[[int], str]) -> tuple[float, float, float]:
    small, large = make(SIZE), make(2 * SIZE)
    times: dict[str, list[float]] = {"small": [], "large": []}
    gc.disable()
    try:
        for _ in range(REPEATS):
            for key, text in (("small", small), ("large", large)):
                t0 = time.process_time()
                _read(name, text)
                times[key].append(time.process_time() - t0)
    finally:
        gc.enable()
    a, b = statistics.median(times["small"]), statistics.median(times["large"])
    return b / max(a, 1e-4), a, b


@pytest.mark.parametrize("name", list(FORMATS))
def test_reading_twice_the_reply_costs_at_most_about_twice_the_time(name: str) -> None:
    slow = []
    for kind, make in _replies(name).items():
        ratio, a, b = _ratio(name, make)
        for _ in range(ROUNDS - 1):  # (again: a busy machine may have slowed one size; a slow reader stays slow)
            if ratio <= RATIO:
                break
            ratio, a, b = _ratio(name, make)
        if ratio > RATIO:
            slow.append(f"{kind}: {1000 * a:.0f} ms -> {1000 * b:.0f} ms (x{ratio:.1f})")
    assert not slow, f"{name}: reading twice the text costs more than {RATIO}x the time: {slow}"
