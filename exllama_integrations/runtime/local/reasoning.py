"""A reasoning model's generation, token by token and text by text.

:class:`ReasoningControl` runs on the backend's side, one token at a time: it knows whether the output
is in the thinking block, counts reasoning tokens, asks the backend to write the end delimiter itself
when the budget is spent, and says when the answer (and so a grammar) begins. It reads each token's own
text, so a delimiter split over several tokens is found too. :class:`ReasoningSplitter` runs on the
reader's side over the detokenized text: it routes text to ``reasoning`` or ``text`` and drops the
delimiters (and the whitespace around them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ...contract.api import Reasoning


class ReasoningControl:
    """One generation's reasoning state on the backend's side (see the module docstring).

    ``piece(token_id)`` is a token's text, special tokens included; ``end_ids`` the end delimiter's tokens.
    """

    def __init__(self, reasoning: Reasoning, piece: Callable[[int], str], end_ids: Sequence[int]) -> None:
        self.reasoning = reasoning
        self._piece = piece
        self.end_ids = tuple(end_ids)
        self._state = "reasoning" if reasoning.started else "maybe"
        self._tail = ""
        self._pending: tuple[int, ...] = ()
        self._forcing = 0
        self._undecided = 0
        self.reasoning_tokens = 0
        """Tokens spent thinking so far (the delimiters included)."""

    def twin(self) -> ReasoningControl:
        """A fresh control for the same request (for a party that must follow the tokens on its own)."""
        return ReasoningControl(self.reasoning, self._piece, self.end_ids)

    @property
    def constrained(self) -> bool:
        """Whether the answer has begun (a grammar applies from here on)."""
        return self._state == "answer"

    @property
    def thinking(self) -> bool:
        """Whether the output is (or may yet be) in the thinking block."""
        return self._state in ("reasoning", "maybe")

    def forced(self) -> tuple[int, ...]:
        """Tokens the backend must write next instead of sampling (the end delimiter, once the budget is spent)."""
        out, self._pending = self._pending, ()
        return out

    def observe(self, token_ids: Sequence[int]) -> None:
        """Advance by tokens the backend produced (sampled or forced), in order."""
        for tid in token_ids:
            self._one(tid)

    def _one(self, tid: int) -> None:
        r = self.reasoning
        if self._state == "answer":
            return
        text = self._piece(tid)
        if self._state == "maybe":
            self._undecided += 1
            self._tail = (self._tail + text).lstrip()
            if not self._tail.startswith(r.start):
                if not r.start.startswith(self._tail):
                    self._state = "answer"  # the model answered without thinking
                return  # whitespace, or part of the start tag: not decided yet
            self._state, self._tail = "reasoning", self._tail[len(r.start) :]
            self.reasoning_tokens += self._undecided
        else:
            self.reasoning_tokens += 1
            self._tail += text
        if self._forcing:
            self._forcing -= 1
            if not self._forcing:  # the end delimiter was written: the answer begins, however it decoded
                self._state, self._tail = "answer", ""
                return
        if r.end in self._tail:
            self._state, self._tail = "answer", ""
            return
        self._tail = self._tail[-len(r.end) :]
        if r.budget is not None and not self._forcing and self.reasoning_tokens >= r.budget:
            self._pending = self.end_ids
            self._forcing = len(self.end_ids)


class ReasoningSplitter:
    """Detokenized text -> (answer text, reasoning text), delimiters and the whitespace around them dropped."""

    def __init__(self, reasoning: Reasoning) -> None:
        self.start, self.end = reasoning.start, reasoning.end
        self._state = "reasoning_start" if reasoning.started else "maybe"
        self._held = ""

    def push(self, text: str) -> tuple[str, str]:
        """Feed new text; return the answer and reasoning text that is safe to show."""
        answer, reasoning = "", ""
        buf = self._held + text
        self._held = ""
        while buf:
            if self._state == "maybe":
                stripped = buf.lstrip()
                if stripped.startswith(self.start):
                    buf, self._state = stripped[len(self.start) :], "reasoning_start"
                elif self.start.startswith(stripped):
                    self._held = buf  # whitespace, or the start of the tag: wait
                    return answer, reasoning
                else:
                    self._state = "answer"
            elif self._state in ("reasoning_start", "answer_start"):
                stripped = buf.lstrip()
                if not stripped:
                    return answer, reasoning  # leading whitespace is dropped
                buf = stripped
                self._state = "reasoning" if self._state == "reasoning_start" else "answer"
            elif self._state == "reasoning":
                at = buf.find(self.end)
                if at >= 0:
                    reasoning += buf[:at].rstrip()
                    buf, self._state = buf[at + len(self.end) :], "answer_start"
                    continue
                keep = _partial_suffix(buf, self.end)
                body = buf[: len(buf) - keep]
                ws = len(body) - len(body.rstrip())  # trailing whitespace waits: it may come before the end tag
                reasoning += body[: len(body) - ws]
                self._held = buf[len(body) - ws :]
                return answer, reasoning
            else:  # answer
                answer += buf
                buf = ""
        return answer, reasoning

    def flush(self) -> tuple[str, str]:
        """End of output: whatever is held goes where it was heading, less a cut-short end delimiter.

        Output that ends inside the end delimiter (``max_tokens`` cut the ``</think>`` the budget forced, after
        ``</thi``) ends the reasoning without that piece: it is our markup, not the model's thought.
        """
        held, self._held = self._held, ""
        if self._state == "reasoning":
            return "", held[: len(held) - _partial_suffix(held, self.end)].rstrip()
        if self._state == "maybe":
            return held, ""
        return "", ""


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (0: none)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


__all__ = ["ReasoningControl", "ReasoningSplitter"]
