"""Constrained decoding with llguidance: a :class:`~.api.Grammar` compiled against the native tokenizer.

A :class:`TokenConstraint` is a compiled, validated grammar; it is immutable and shared by every
generation that uses it (the runtime caches them). Each generation gets its own
:class:`ConstraintMatcher`: logits-level backends (CPU reference, ExLlama v1/v2) apply its token
bitmask to the logits before sampling, exllamav3 gets the same grammar as its own
``LLGuidanceFilter``, and the runtime alone feeds it the generated tokens. End-of-turn tokens are
allowed only where the grammar accepts, so output never ends early and never starts with an
end-of-turn token. The mask is applied with numpy and torch indexing (no ``torch.compile``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import ConstraintError, MissingDependencyError

if TYPE_CHECKING:
    import torch

    from .api import Grammar
    from .tokenizer import NativeTokenizer

# Compact, predictable JSON: one space after ':' and ',' and no other whitespace, which small models
# follow best and which keeps a length budget honest.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_ll_lock = threading.Lock()
MAX_SCHEMA_DEPTH = 100
"""Deepest nesting of a schema accepted (beyond it, compilers and serializers recurse out of stack)."""


def check_depth(obj: Any, what: str = "the JSON schema") -> None:
    """Refuse a structure nested deeper than MAX_SCHEMA_DEPTH (checked without recursion).

    Raises:
        ConstraintError: it is nested too deeply.
    """
    stack = [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise ConstraintError(
                f"{what} is nested too deeply (over {MAX_SCHEMA_DEPTH} levels) to compile; flatten it."
            )
        if isinstance(item, Mapping):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend((v, depth + 1) for v in item)


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
        try:
            err = llg.LLMatcher.validate_grammar(grammar, self._llt)
        except (ValueError, RuntimeError) as e:
            err = str(e)
        if err and not err.startswith("WARNING"):
            raise ConstraintError(f"{description} could not be compiled: {err.strip()}")

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
        self._matcher = _llguidance().LLMatcher(constraint._llt, constraint.grammar, log_level=0)
        if self._matcher.is_error():
            raise ConstraintError(f"{constraint.description} could not be compiled: {self._matcher.get_error()}")

    def _allowed(self, vocab: int) -> Any:
        import numpy as np

        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little").astype(bool)
        if allowed.shape[0] < vocab:
            allowed = np.concatenate([allowed, np.zeros(vocab - allowed.shape[0], dtype=bool)])
        return allowed[:vocab]

    def mask_logits(self, scores: torch.Tensor) -> None:
        """Set the logits of tokens the grammar forbids to -inf, in place ([1, vocab] tensor)."""
        import torch

        allowed = torch.from_numpy(self._allowed(scores.shape[-1])).to(scores.device)
        scores.masked_fill_(~allowed.unsqueeze(0), float("-inf"))

    def accept(self, token: int) -> None:
        """Advance the grammar by a generated token."""
        if not self._matcher.is_stopped():
            self._matcher.consume_token(int(token))

    def is_accepting(self) -> bool:
        """Whether the output so far is complete under the grammar."""
        return bool(self._matcher.is_accepting())

    def exllamav3_filter(self, xtokenizer: Any) -> Any:
        """The same grammar as an exllamav3 ``LLGuidanceFilter`` (ends the job when the grammar completes)."""
        from exllamav3 import LLGuidanceFilter

        return LLGuidanceFilter(xtokenizer, llg_grammar=self.constraint.grammar, eos_after_completed=True)


def strict_schema(schema: Any) -> Any:
    """A copy of ``schema`` whose objects allow no keys beyond their ``properties``.

    Applied to objects that do not say ``additionalProperties``: what a caller who wrote the schema
    means, and what keeps small models from inventing keys.
    """
    if isinstance(schema, list):
        return [strict_schema(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def tool_call_grammar(tools: Sequence[Mapping[str, Any]], open_tag: str, close_tag: str) -> str:
    """Lark grammar: exactly one ``open_tag {"name": ..., "arguments": {...}} close_tag`` for one of ``tools``.

    ``tools`` are OpenAI-format function specs. The arguments must follow that tool's parameter schema.
    """
    variants = []
    for t in tools:
        f = t["function"]
        # A forced call carries exactly the declared arguments (no invented extra keys).
        params = strict_schema(f.get("parameters") or {"type": "object", "properties": {}})
        params.setdefault("additionalProperties", False)
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    body = json.dumps({**schema, "x-guidance": JSON_OPTIONS})
    return f"start: {json.dumps(open_tag)} call {json.dumps(close_tag)}\ncall: %json {body}\n"
