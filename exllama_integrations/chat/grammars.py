"""The grammars a chat call needs: a forced tool call, a strict structured reply, and either after thinking.

Each is built from OpenAI-shaped specs into a :class:`~exllama_integrations.contract.api.Grammar` value; the
backend that runs a reasoning request applies it only after the thinking block (see ``Reasoning``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ..model.grammar import JSON_OPTIONS


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
