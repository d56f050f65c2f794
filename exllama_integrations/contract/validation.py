"""Validation of untrusted data that stops at a container's first bad item.

pydantic validates a list item by item and collects every item's error: a 3 MB body holding a million wrong
items builds millions of error objects (seconds of CPU and gigabytes) for an answer that shows five. Every
list, tuple, set and dict schema of a model read from outside is made ``fail_fast`` here, so a container reports
its first bad item and validation stops there: the cost of a bad body is at most the cost of a good one of the
same size (one linear pass). Unions of containers try each shape once, each stopping at its first bad item.

:class:`FirstErrorModel` is the base of every request model a server reads (OpenAI's, the Responses API's,
Anthropic's, rerank's); :func:`first_error_reader` is the same for a contract value read from the wire form.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel, GetCoreSchemaHandler, TypeAdapter
from pydantic_core import CoreSchema, SchemaValidator

_CONTAINERS = frozenset({"list", "tuple", "set", "frozenset", "dict"})


def stop_at_first_error(schema: CoreSchema) -> CoreSchema:
    """``schema`` with every container in it (nested ones, definitions and union members too) ``fail_fast``."""
    seen: set[int] = set()
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if id(node) in seen:
                continue
            seen.add(id(node))
            kind = node.get("type")
            if isinstance(kind, str) and kind in _CONTAINERS:
                node["fail_fast"] = True
            stack.extend(v for k, v in node.items() if k != "metadata")  # metadata: pydantic's notes, no schema
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return schema


class FirstErrorModel(BaseModel):
    """A model read from untrusted data: each container in it stops at its first bad item (see the module)."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: type[BaseModel], handler: GetCoreSchemaHandler) -> CoreSchema:
        """The model's schema, its containers ``fail_fast``."""
        return stop_at_first_error(handler(source))


def first_error_reader(kind: Any) -> SchemaValidator:
    """A validator of ``kind`` (a contract dataclass) whose containers stop at their first bad item."""
    return SchemaValidator(stop_at_first_error(copy.deepcopy(TypeAdapter(kind).core_schema)))


__all__ = ["FirstErrorModel", "first_error_reader", "stop_at_first_error"]
