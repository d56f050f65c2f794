"""A constraint on a generation's output, as data (:class:`Grammar`), and the bounds on what a client may send.

Part of the contract (:mod:`.api` re-exports every name): a grammar crosses a thread, a process or a network as
its kind and source text; the runtime compiles it against its tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import ConstraintError

GrammarKind = Literal["json_schema", "regex", "lark"]
GRAMMAR_KINDS: tuple[str, ...] = ("json_schema", "regex", "lark")
MAX_SCHEMA_DEPTH = 100
"""Deepest nesting of a schema accepted (beyond it, compilers and serializers recurse out of stack)."""
MAX_GRAMMAR_CHARS = 256 * 1024
"""Longest grammar a client may send a server (``grammar`` on ``/v1/completions``, a native request's grammar).

A grammar's compile time grows faster than its size (llguidance: 420 KB of Lark alternatives ~0.7 s, 840 KB ~6 s
on one core); what a client sends is refused over this at the door, and every grammar's compile, those built from
tools and schemas included, is also held to a time budget (``model.grammar_worker.COMPILE_SECONDS``)."""


def check_grammar_size(grammar: Grammar | None, param: str = "grammar") -> None:
    """Refuse a grammar a client sent that is longer than ``MAX_GRAMMAR_CHARS`` (before anything compiles it).

    Raises:
        ConstraintError: (400) naming the limit.
    """
    if grammar is not None and len(grammar.source) > MAX_GRAMMAR_CHARS:
        e = ConstraintError(
            f"the {grammar.kind} grammar is {len(grammar.source)} characters; a grammar sent to this server may be "
            f"at most {MAX_GRAMMAR_CHARS} (MAX_GRAMMAR_CHARS): send a smaller one (a JSON schema's enum is far "
            "cheaper than the same words as Lark alternatives)."
        )
        e.param = param
        raise e


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


@dataclass(frozen=True)
class Grammar:
    """A constraint on the output, as data: the runtime compiles it against its tokenizer.

    ``json_schema``: ``source`` is a JSON schema's text (its properties in the order they were given);
    ``regex``: a Rust-syntax regex; ``lark``: a Lark grammar in llguidance's dialect (``%json {...}``
    embeds a schema).

    Example:
        >>> g = Grammar.json_schema({"type": "object", "properties": {"b": {"type": "integer"}, "a": {}}})
        >>> g.kind, list(json.loads(g.source)["properties"])
        ('json_schema', ['b', 'a'])
    """

    kind: GrammarKind
    source: str

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ConstraintError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, not {self.kind!r}.")
        if not isinstance(self.source, str):
            raise ConstraintError(f"a grammar's source must be text, got {type(self.source).__name__}.")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str) -> Grammar:
        """Output must be JSON valid under ``schema`` (a dict, or its JSON text). The properties keep their order."""
        if isinstance(schema, str):
            return cls("json_schema", schema)
        check_depth(schema)
        try:
            # never sort_keys: a model writes the properties in the schema's order ("reason, then answer")
            return cls("json_schema", json.dumps(schema, ensure_ascii=False))
        except (TypeError, ValueError, RecursionError) as e:
            raise ConstraintError(f"the JSON schema cannot be serialized: {type(e).__name__}: {e}") from None

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """Output must match ``pattern`` (Rust regex syntax: no look-around or back-references)."""
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> Grammar:
        """Output must match a Lark grammar (llguidance dialect)."""
        return cls("lark", grammar)


__all__ = [
    "GRAMMAR_KINDS",
    "MAX_GRAMMAR_CHARS",
    "MAX_SCHEMA_DEPTH",
    "Grammar",
    "GrammarKind",
    "check_depth",
    "check_grammar_size",
]
