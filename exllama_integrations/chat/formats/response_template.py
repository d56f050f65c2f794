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

A template is the checkpoint's, so untrusted. It is refused at load (logged; the family table reads the calls) when
it is nested deeper than ``MAX_TEMPLATE_DEPTH`` or one of its regexes backtracks on a probe (runs of one character,
its own delimiters; ``PROBE_SECONDS`` each, the ``regex`` module's own timeout); and every regex the parser runs on
a reply spends from that reply's ``READ_SECONDS``, past which the reply ends with a typed
:class:`~exllama_integrations.errors.ChatTemplateError`, so no template can hold the event loop that reads replies.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from copy import deepcopy
from typing import Any

from ...errors import ChatTemplateError

logger = logging.getLogger(__name__)

CUT_OFF = "cut off by max_tokens before the call was complete"
"""The ``error`` of a call that ``max_tokens`` cut short (whoever read it: a response template or the table)."""

FoundCall = tuple[str | None, Any, str, str | None]
"""A call as the template read it: name, arguments (None: it did not read), the region's text, why it did not read."""

CALLS = "tool_calls"
"""The region a response template writes calls to (transformers' name, as in the assistant message)."""
MAX_TEMPLATE_DEPTH = 32
"""Deepest nesting of a response template's data (transforms, content arguments) taken at load."""
PROBE_SECONDS = 0.05
"""Seconds each of a template's regexes may take on each probe at load before the template is refused."""
READ_SECONDS = 0.25
"""Seconds of regex matching one reply may spend in all (a reply is read on the server's event loop)."""
PATTERN_KEYS = ("open_pattern", "close_pattern", "start_anchor_pattern", "tag_pattern")
"""The keys whose values are regexes, at any depth of a template."""


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
        _check_shape(spec)
        load_response_template(deepcopy(spec))
        _raw_calls_template(spec)
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError, ChatTemplateError) as e:
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


def _walk(spec: Any) -> Iterator[tuple[Any, int]]:
    """Every value in ``spec`` with its depth (without recursion)."""
    stack = [(spec, 1)]
    while stack:
        item, depth = stack.pop()
        yield item, depth
        if depth > MAX_TEMPLATE_DEPTH:
            continue
        if isinstance(item, Mapping):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)


def _check_shape(spec: Any) -> None:
    """Refuse a template nested too deeply, or with a regex that backtracks on a probe.

    Raises:
        ChatTemplateError: naming what is refused.
    """
    import regex

    patterns, literals = [], []
    for item, depth in _walk(spec):
        if depth > MAX_TEMPLATE_DEPTH:
            raise ChatTemplateError(f"the response_template is nested deeper than {MAX_TEMPLATE_DEPTH} levels")
        if isinstance(item, Mapping):
            patterns += [v for k, v in item.items() if k in PATTERN_KEYS and isinstance(v, str)]
            for key in ("open", "close", "start_anchor"):
                value = item.get(key)
                literals += [value] if isinstance(value, str) else [v for v in value or () if isinstance(v, str)]
    probes = [c * 28 + end for c in "a0_ .<>\n\"'{}=,é" for end in ("", "\x00", "!")]
    probes += [(lit * 10)[:400] + end for lit in literals if lit for end in ("", "\x00")]
    for pattern in patterns:
        try:
            compiled = regex.compile(pattern, regex.DOTALL)
            for probe in probes:
                compiled.search(probe, timeout=PROBE_SECONDS)
                compiled.search(probe, partial=True, timeout=PROBE_SECONDS)
        except TimeoutError:
            raise ChatTemplateError(
                f"the response_template's regex {pattern[:80]!r} took over {PROBE_SECONDS:g} s on a "
                f"{len(probe)}-character probe (it backtracks)"
            ) from None
        except regex.error:
            continue  # transformers' own loading says what is wrong with it


class _Budget:
    """The regex time one reply may spend (``READ_SECONDS``), spent by every match the parser makes."""

    def __init__(self, seconds: float) -> None:
        self.left = seconds

    def run(self, call: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.left <= 0:
            raise self._over()
        t0 = time.perf_counter()
        try:
            return call(*args, timeout=self.left, **kwargs)
        except TimeoutError:
            self.left = 0.0
            raise self._over() from None
        finally:
            self.left -= time.perf_counter() - t0

    @staticmethod
    def _over() -> ChatTemplateError:
        return ChatTemplateError(
            f"the model's response_template spent over {READ_SECONDS:g} s of regex matching on one reply (a regex "
            "that backtracks); serve it with --tool-format NAME to read its calls with the family table instead."
        )


class _Bounded:
    """A compiled regex whose matches spend from a reply's :class:`_Budget` (the ``regex`` module's timeout)."""

    def __init__(self, pattern: Any, budget: _Budget) -> None:
        self._pattern, self._budget = pattern, budget

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pattern, name)  # groupindex, pattern, flags ...

    def search(self, *args: Any, **kwargs: Any) -> Any:
        return self._budget.run(self._pattern.search, args, kwargs)

    def match(self, *args: Any, **kwargs: Any) -> Any:
        return self._budget.run(self._pattern.match, args, kwargs)

    def fullmatch(self, *args: Any, **kwargs: Any) -> Any:
        return self._budget.run(self._pattern.fullmatch, args, kwargs)

    def finditer(self, *args: Any, **kwargs: Any) -> Any:
        return iter(self._budget.run(lambda *a, **k: list(self._pattern.finditer(*a, **k)), args, kwargs))


def _bounded(template: Any, budget: _Budget) -> Any:
    """A loaded template whose delimiters' regexes spend from ``budget``."""
    for field in template.fields.values():
        for key in ("open_re", "close_re"):
            if getattr(field, key) is not None:
                setattr(field, key, _Bounded(getattr(field, key), budget))
    if template.start_anchor_re is not None:
        template.start_anchor_re = _Bounded(template.start_anchor_re, budget)
    return template


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
        self._budget = _Budget(READ_SECONDS)
        template = _bounded(load_response_template(_raw_calls_template(spec)), self._budget)
        # prefix="": the reader is given the answer alone (the runtime has taken the thinking and the prompt apart)
        self._parser = ResponseParser(template, prefix="")
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
        except Exception as e:  # noqa: BLE001 - whatever the model wrote, a region that does not read is an invalid call
            why = CUT_OFF if cut else f"{type(e).__name__}: {e}"
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
