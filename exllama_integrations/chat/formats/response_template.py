"""A checkpoint's own reply format: the ``response_template`` its tokenizer_config.json declares, read by transformers.

transformers (5.x) takes a declarative ``response_template`` from tokenizer_config.json (regions such as
``tool_calls`` / ``content`` / ``reasoning_content`` that open and close on literals or patterns, a content parser
for each: ``json``, ``xml-inline``, ``python-call-list``, ..., and a transform into OpenAI's call shape) and reads
replies with it incrementally (``transformers.utils.chat_parsing.ResponseParser``). A model directory that carries
one has its tool calls read with that parser, ahead of our family table; the table's entry (found from the chat
template) still writes calls (the forced-call grammar, the history), which a response template does not describe.

:class:`TemplateReader` is :class:`~.reader.ReplyReader`'s reading for such a format: the parser finds the regions
(holding back a partial delimiter), and each ``tool_calls`` region is parsed here with transformers' own content
parser and transform, so that a region that does not read becomes an invalid call with its text (as in every other
format) instead of an exception in the middle of a stream.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Mapping
from copy import deepcopy
from typing import Any

logger = logging.getLogger(__name__)

FoundCall = tuple[str | None, Any, str, str | None]
"""A call as the template read it: name, arguments (None: it did not read), the region's text, why it did not read."""

CALLS = "tool_calls"
"""The region a response template writes calls to (transformers' name, as in the assistant message)."""


@functools.cache
def parser_available() -> bool:
    """Whether transformers' response parser can be imported here (the ``transformers`` extra, 5.x)."""
    try:
        from transformers.utils.chat_parsing import ResponseParser  # noqa: F401
    except ImportError:
        return False
    return True


def response_template_of(tokenizer_config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``response_template`` a tokenizer_config.json declares, where transformers reads it and it has calls.

    None where there is none, it has no ``tool_calls`` region, transformers (5.x) is not installed, or the
    template does not load (each logged: the family table reads the model's calls instead).
    """
    spec = tokenizer_config.get("response_template")
    if spec is None:
        return None
    if not parser_available():
        logger.warning(
            "the model declares a response_template, but transformers' response parser is not installed "
            "(install `exllama-integrations[transformers]` with transformers 5.x); tool calls are read by family"
        )
        return None
    from transformers.utils.chat_parsing.response_templates import load_response_template

    try:
        load_response_template(deepcopy(spec))
        _raw_calls_template(spec)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        logger.warning("the model's response_template does not load (%s); tool calls are read by family", e)
        return None
    if CALLS not in spec["fields"]:
        return None
    return dict(spec)


READ_WITH = "tool_calls_read_with"
"""The model info's ``details`` key that says a model's calls are read with its own response template."""


def template_details(spec: Mapping[str, Any] | None) -> dict[str, Any]:
    """What a model's info says of its response template: the template itself and that calls are read with it."""
    if spec is None:
        return {}
    return {READ_WITH: "response_template (tokenizer_config.json)", "response_template": dict(spec)}


def without_template(details: Mapping[str, Any]) -> dict[str, Any]:
    """``details`` less the response template (a format named by the user reads the calls instead)."""
    return {k: v for k, v in details.items() if k not in (READ_WITH, "response_template")}


def template_markup(spec: Mapping[str, Any]) -> tuple[str, ...]:
    """The literals that open and close the template's regions (what a reply must show as text to be read)."""
    out: list[str] = []
    for field in spec.get("fields", {}).values():
        for key in ("open", "close"):
            value = field.get(key)
            out += [value] if isinstance(value, str) else list(value or [])
    return tuple(dict.fromkeys(out))


def _raw_calls_template(spec: Mapping[str, Any]) -> dict[str, Any]:
    """``spec`` with its ``tool_calls`` region read as raw text (its captures kept), for :class:`TemplateReader`."""
    import regex

    raw = deepcopy(dict(spec))
    field = raw["fields"].get(CALLS)
    if field is None:
        return raw
    groups: set[str] = set()
    for key in ("open_pattern", "close_pattern"):
        if key in field:
            groups |= set(regex.compile(field[key]).groupindex)
    field.pop("join", None)
    field.pop("transform_each", None)
    field.update(content="text", content_args={"strip": False})
    field["transform"] = {"__body__": "{content}", **{g: "{" + g + "}" for g in sorted(groups)}}
    return raw


class TemplateReader:
    """Reads one reply with a response template: :meth:`feed` text as it comes, then :meth:`finish`.

    Both return (answer text now safe to show, calls completed by it); calls are ``(name, arguments, raw,
    error)`` tuples, made into :class:`~.reader.ParsedToolCall` values (arguments typed by the tools' schemas) by
    the reader.
    """

    def __init__(self, spec: Mapping[str, Any]) -> None:
        from transformers.utils.chat_parsing import ResponseParser
        from transformers.utils.chat_parsing.response_templates import load_response_template

        self._field = load_response_template(deepcopy(dict(spec))).fields[CALLS]
        # prefix="": the reader is given the answer alone (the runtime has taken the thinking and the prompt apart)
        self._parser = ResponseParser(load_response_template(_raw_calls_template(spec)), prefix="")
        self._after_call = False

    def feed(self, text: str) -> tuple[str, list[FoundCall]]:
        """Take more reply text."""
        return self._read(self._parser.feed(text), cut=False)

    def finish(self, cut: bool = False) -> tuple[str, list[FoundCall]]:
        """End of the reply (``cut``: by ``max_tokens``)."""
        _, events = self._parser.finalize()
        return self._read(events, cut)

    def _read(self, events: list[dict[str, Any]], cut: bool) -> tuple[str, list[FoundCall]]:
        text: list[str] = []
        calls: list[FoundCall] = []
        for event in events:
            if event["field"] == CALLS:
                if event["type"] == "region_close":
                    calls += self._calls(event["value"], cut)
                    self._after_call = True
            elif event["type"] == "region_chunk":
                piece = event["text"].lstrip() if self._after_call else event["text"]
                if piece:
                    self._after_call = False  # whitespace right after a call is the calls' separator, not text
                    text.append(piece)
        return "".join(text), calls

    def _calls(self, value: Mapping[str, Any], cut: bool) -> list[FoundCall]:
        from transformers.utils.chat_parsing.content_parsers import process_field

        body = value["__body__"]
        captures = {k: v for k, v in value.items() if k != "__body__" and v is not None}
        if not body.strip() and not captures:
            return []  # an open with nothing after it at the very end: markup, not a call
        try:
            parsed = process_field(body, self._field, captures)
            items = parsed if isinstance(parsed, list) else [parsed]
            found = [_call(item) for item in items]
            if not found:
                raise ValueError("no call in the region")
        except (ValueError, TypeError, KeyError, RecursionError) as e:
            why = "cut off by max_tokens before the call was complete" if cut else f"{type(e).__name__}: {e}"
            name = captures.get("name") if isinstance(captures.get("name"), str) else None
            return [(name, None, body, why)]
        return [(name, args, body, None) for name, args in found]


def _call(item: Any) -> tuple[str, dict[str, Any]]:
    """One parsed call (``{"type": "function", "function": {...}}`` or ``{"name", "arguments"}``) as name, arguments."""
    if isinstance(item, Mapping) and isinstance(item.get("function"), Mapping):
        item = item["function"]
    if not isinstance(item, Mapping):
        raise TypeError("a call must be an object with a name and arguments")
    name = item["name"]
    if not isinstance(name, str) or not name.strip():
        raise TypeError("the call's name must be a non-empty string")
    args: Any = item.get("arguments", item.get("parameters", {}))
    if isinstance(args, str):
        args = json.loads(args) if args.strip() else {}
    if not isinstance(args, dict):
        raise TypeError("the arguments must be a JSON object")
    return name.strip(), args


__all__ = [
    "CALLS",
    "READ_WITH",
    "FoundCall",
    "template_details",
    "without_template",
    "TemplateReader",
    "parser_available",
    "response_template_of",
    "template_markup",
]
