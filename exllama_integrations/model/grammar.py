"""Constrained decoding with llguidance, against the native tokenizer.

A :class:`TokenConstraint` is a compiled, validated grammar; it is immutable and shared by every generation that
uses it (the runtime caches them). It holds one compiled matcher at the grammar's start; each generation gets its
own :class:`ConstraintMatcher`, a copy of that one (milliseconds, where compiling again can take seconds), owned
by the backend that runs it: logits-level backends (CPU reference, ExLlama v1/v2) apply its token bitmask to the
logits before sampling and feed it the token they chose; exllamav3 runs it as the job's filter. The runtime only
reads it (is the output complete?). End-of-turn tokens are allowed only where the grammar accepts, so output never
ends early and never starts with an end-of-turn token. The mask is applied with numpy and torch indexing (no
``torch.compile``).
"""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING, Any

from ..errors import ConstraintError, MissingDependencyError

if TYPE_CHECKING:
    import torch

    from ..contract.api import Grammar
    from .tokenizer import NativeTokenizer

# Compact, predictable JSON: one space after ':' and ',' and no other whitespace, which small models
# follow best and which keeps a length budget honest.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_ll_lock = threading.Lock()


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise MissingDependencyError("llguidance", "constraints", "constrained decoding") from None
    return llguidance


def ll_tokenizer(tokenizer: NativeTokenizer) -> Any:
    """The llguidance tokenizer for a native tokenizer, built once and cached on it."""
    cached = getattr(tokenizer, "_ll_tokenizer", None)
    if cached is not None:
        return cached
    llg = _llguidance()
    with _ll_lock:
        cached = getattr(tokenizer, "_ll_tokenizer", None)
        if cached is not None:
            return cached
        tj = tokenizer.tokenizer_json_str()
        if tj is not None:
            llt = llg.LLTokenizer(tj, eos_token=tokenizer.eos_token_ids or None)
        else:
            llt = llg.LLTokenizer(llg.TokenizerWrapper(_SentencePieceView(tokenizer)))
        tokenizer._ll_tokenizer = llt  # type: ignore[attr-defined]
        return llt


class _SentencePieceView:
    """What llguidance's TokenizerWrapper needs from a sentencepiece tokenizer."""

    def __init__(self, tok: NativeTokenizer) -> None:
        self.tokens = tok.token_bytes()
        self.eos_token_id = (tok.eos_token_ids or [0])[0]
        self.bos_token_id = tok.bos_token_id
        self.special_token_ids = sorted(tok.special_ids)
        self._tok = tok

    def __call__(self, s: str) -> list[int]:
        return self._tok.encode(s, add_special_tokens=False)


class TokenConstraint:
    """A compiled grammar: :meth:`compile` a Grammar (or :meth:`json_schema`, :meth:`regex`, :meth:`lark`).

    Example:
        >>> c = TokenConstraint.compile(rt.tokenizer, Grammar.json_schema({"type": "object"}))  # doctest: +SKIP
        >>> rt.generate("JSON:", grammar=Grammar.json_schema({"type": "object"})).text  # doctest: +SKIP
        '{"answer": 42}'
    """

    def __init__(self, tokenizer: NativeTokenizer, grammar: str, description: str) -> None:
        llg = _llguidance()
        self.tokenizer = tokenizer
        self.grammar = grammar
        self.description = description
        self._llt = ll_tokenizer(tokenizer)
        # compiled once (llguidance drops the GIL while it compiles); each generation copies it
        self._start = llg.LLMatcher(self._llt, grammar, log_level=0)
        if self._start.is_error():
            raise ConstraintError(f"{description} could not be compiled: {self._start.get_error().strip()}")
        self._copy_lock = threading.Lock()

    @classmethod
    def compile(cls, tokenizer: NativeTokenizer, grammar: Grammar) -> TokenConstraint:
        """Compile a grammar value.

        Raises:
            ConstraintError: it does not compile (the message quotes llguidance).
        """
        if grammar.kind == "json_schema":
            return cls.json_schema(tokenizer, grammar.source)
        if grammar.kind == "regex":
            return cls.regex(tokenizer, grammar.source)
        return cls.lark(tokenizer, grammar.source)

    @classmethod
    def json_schema(cls, tokenizer: NativeTokenizer, schema: dict[str, Any] | str) -> TokenConstraint:
        """Output must be JSON valid under ``schema``.

        Raises:
            ConstraintError: the schema is not valid JSON or not a JSON schema llguidance understands.
        """
        llg = _llguidance()
        try:
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ConstraintError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ConstraintError(f"a JSON schema must be an object, got {type(schema).__name__}")
            grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise ConstraintError(f"invalid JSON schema: {e}") from None
        except RecursionError:
            raise ConstraintError("the JSON schema is nested too deeply to compile; flatten it.") from None
        return cls(tokenizer, grammar, "the JSON schema")

    @classmethod
    def regex(cls, tokenizer: NativeTokenizer, pattern: str) -> TokenConstraint:
        """Output must match ``pattern`` (Rust regex syntax: no look-around or back-references)."""
        return cls(tokenizer, _llguidance().LLMatcher.grammar_from_regex(pattern), "the regex")

    @classmethod
    def lark(cls, tokenizer: NativeTokenizer, grammar: str) -> TokenConstraint:
        """Output must match a Lark grammar (llguidance dialect: ``%json {...}`` embeds a JSON schema)."""
        return cls(tokenizer, _llguidance().LLMatcher.grammar_from_lark(grammar), "the Lark grammar")

    def matcher(self) -> ConstraintMatcher:
        """A fresh matcher for one generation."""
        return ConstraintMatcher(self)


class ConstraintMatcher:
    """One generation's position in a grammar: the mask for the next token, fed each token chosen."""

    def __init__(self, constraint: TokenConstraint) -> None:
        self.constraint = constraint
        with constraint._copy_lock:
            self._matcher = constraint._start.deep_copy()
        self._packed: Any = None

    def _bits(self) -> Any:
        import numpy as np

        return np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)

    def _allowed(self, vocab: int) -> Any:
        import numpy as np

        allowed = np.unpackbits(self._bits(), bitorder="little").astype(bool)
        if allowed.shape[0] < vocab:
            allowed = np.concatenate([allowed, np.zeros(vocab - allowed.shape[0], dtype=bool)])
        return allowed[:vocab]

    def mask_logits(self, scores: torch.Tensor) -> None:
        """Set the logits of tokens the grammar forbids to -inf, in place ([1, vocab] tensor)."""
        import torch

        allowed = torch.from_numpy(self._allowed(scores.shape[-1])).to(scores.device)
        scores.masked_fill_(~allowed.unsqueeze(0), float("-inf"))

    def packed_mask(self) -> torch.Tensor:
        """The mask as a packed int32 bitmask [1, ceil(vocab / 32)] (bit set: allowed), exllamav3's filter form."""
        import numpy as np
        import torch

        words = self._bits().view(np.int32)
        if self._packed is None or self._packed.shape[-1] != words.shape[0]:
            self._packed = torch.empty((1, words.shape[0]), dtype=torch.int32)
        self._packed[0].copy_(torch.from_numpy(words.copy()))
        return self._packed

    def accept(self, token: int) -> None:
        """Advance the grammar by a generated token."""
        if not self._matcher.is_stopped():
            self._matcher.consume_token(int(token))

    def reset(self) -> None:
        """Back to the start of the grammar."""
        self._matcher.reset()

    def is_stopped(self) -> bool:
        """Whether the grammar allows nothing more (complete and closed)."""
        return bool(self._matcher.is_stopped())

    def is_accepting(self) -> bool:
        """Whether the output so far is complete under the grammar."""
        return bool(self._matcher.is_accepting())
