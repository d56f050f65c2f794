"""The forced-call grammar of a family, derived from its table entry's ``call`` text.

``tool_choice="required"`` or a named tool: the reply must be well-formed calls in the family's own syntax,
each to one of the forced tools with arguments valid under that tool's schema. The grammar is the entry's
``before``, its ``call`` with the slots filled (the tool's name; its arguments as JSON, XML parameters or Python
keyword arguments by the schema), ``between`` further calls where the family and ``parallel_tool_calls`` allow,
and its ``after``. Markup that is one special token of the model is matched as that token (``<[id]>``), so
the grammar asks for exactly what the family's template shows the model.
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ...errors import InvalidSettingsError
from ...model.grammar import JSON_OPTIONS
from .reader import read_reply
from .table import SPECIAL_SHAPE, ToolFormat
from .tagged import SLOTS, slot_rule, write_slots
from .values import text_kinds

MAX_PARALLEL = 4
"""Most calls a forced reply may hold where the family writes several."""


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


def _params(tool: Mapping[str, Any]) -> dict[str, Any]:
    params = strict_schema(tool["function"].get("parameters") or {"type": "object", "properties": {}})
    params.setdefault("type", "object")
    params.setdefault("additionalProperties", False)
    return dict(params)


def forced_call_grammar(
    fmt: ToolFormat,
    tools: Sequence[Mapping[str, Any]],
    token_of: Callable[[str], int | None],
    parallel: bool = True,
    ends: Collection[int] = (),
    most: int | None = None,
) -> str:
    """Lark (llguidance dialect): well-formed calls of ``fmt`` to ``tools`` (OpenAI function specs).

    ``token_of(text)``: the id of ``text`` where it is one token of the model, else None. ``ends``: the model's
    end-of-turn ids; a call that ends on one (harmony's ``<|call|>``) ends the grammar there, and the model then
    writes it as the end of its turn (a grammar may not ask for an end-of-turn token itself). ``most``: the most
    calls handed out (``max_tool_calls``), so the model writes no call that nobody receives (at most
    :data:`MAX_PARALLEL`; None: that many).
    """
    g = _Builder(token_of, fmt.markup, frozenset(ends))
    alternatives = []
    for i, tool in enumerate(tools):
        alternatives.append(g.call(fmt, tool, f"c{i}"))
    rules = [f"call: {' | '.join(alternatives)}"]
    limit = MAX_PARALLEL if most is None else max(1, min(most, MAX_PARALLEL))
    many = parallel and fmt.parallel and len(tools) > 0 and limit > 1
    calls = f"call ({g.lit(fmt.between)} call){{0,{limit - 1}}}" if many and fmt.between else "call"
    if many and not fmt.between:
        calls = f"call{{1,{limit}}}"
    start = " ".join(p for p in (g.lit(fmt.before), calls, g.lit(fmt.after)) if p)
    return "\n".join([f"start: {start}", *rules, *g.rules]) + "\n"


class _Builder:
    def __init__(self, token_of: Callable[[str], int | None], markup: Sequence[str], ends: frozenset[int]) -> None:
        self.token_of, self.ends = token_of, ends
        self.rules: list[str] = []
        literals = sorted((m for m in markup if m.strip() and token_of(m) is not None), key=len, reverse=True)
        self._pieces = re.compile("(" + "|".join([*map(re.escape, literals), SPECIAL_SHAPE.pattern[1:-1]]) + ")")

    def lit(self, text: str) -> str:
        """``text`` as lark: markup that is one token of the model as that token (``<[id]>``), the rest quoted.

        A tokenizer keeps a family's markup as tokens of its own (special or not, as Qwen's ``<tool_call>``), and
        the model was trained to write those tokens, not the same text spelled in pieces.
        """
        if not text:
            return ""
        out = []
        for piece in self._pieces.split(text):
            if not piece:
                continue
            tid = self.token_of(piece) if self._pieces.fullmatch(piece) else None
            if tid is not None and tid in self.ends:
                continue
            out.append(f"<[{tid}]>" if tid is not None else json.dumps(piece))
        return " ".join(out)

    def call(self, fmt: ToolFormat, tool: Mapping[str, Any], rule: str) -> str:
        name = tool["function"]["name"]
        params = _params(tool)
        parts = []
        for literal, slot, _, _ in string.Formatter().parse(fmt.call):
            if literal:
                parts.append(self.lit(literal))
            if slot is None:
                continue
            if slot == "name":
                parts.append(json.dumps(name))
            elif slot == "name_json":
                parts.append(json.dumps(json.dumps(name, ensure_ascii=False)))  # as templates write it
            elif slot == "arguments":
                parts.append(self.json_rule(f"{rule}_args", params))
            elif slot == "xml_parameters":
                parts.append(self.keyword_rule(f"{rule}_xml", params, xml=True))
            elif slot == "python_arguments":
                parts.append(self.keyword_rule(f"{rule}_py", params, xml=False))
            elif slot in SLOTS:
                parts.append(slot_rule(self, fmt.body_args, slot, f"{rule}_kv", params))
            else:
                raise ValueError(f"unknown slot {{{slot}}} in the {fmt.name} call text")
        self.rules.append(f"{rule}: {' '.join(p for p in parts if p)}")
        return rule

    def json_rule(self, rule: str, schema: Any) -> str:
        self.rules.append(f"{rule}: %json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}")
        return rule

    def keyword_rule(self, rule: str, params: Mapping[str, Any], xml: bool) -> str:
        """Each property as ``<parameter=K>`` V ``</parameter>`` lines (XML) or ``K=V`` (Python); required first."""
        props: Mapping[str, Any] = params.get("properties") or {}
        required = set(params.get("required") or ())
        names = [k for k in props if k in required] + [k for k in props if k not in required]
        items = []
        for j, key in enumerate(names):
            value = self.value_rule(f"{rule}_{j}", props[key], xml)
            if xml:
                opener, closer = json.dumps(f"<parameter={key}>\n"), json.dumps("\n</parameter>\n")
                item = f"{opener} {value} {closer}"
            else:
                item = f"{json.dumps(key + '=')} {value}"
            items.append((item, key in required))
        if not items:
            self.rules.append(f'{rule}: ""')
            return rule
        if not xml and not items[0][1]:  # no argument is required: any of them (in order) or none, comma-separated
            for j in reversed(range(len(items))):
                rest = f' (", " {rule}_from{j + 1})? | {rule}_from{j + 1}' if j + 1 < len(items) else ""
                self.rules.append(f"{rule}_from{j}: {items[j][0]}{rest}")
            self.rules.append(f'{rule}: {rule}_from0 | ""')
            return rule
        seq = []
        for j, (item, req) in enumerate(items):
            sep = "" if xml or j == 0 else '", " '  # (a first Python argument is a required one here)
            seq.append(f"{sep}{item}" if req else f"({sep}{item})?")
        self.rules.append(f"{rule}: {' '.join(seq)}")
        return rule

    def value_rule(self, rule: str, schema: Any, xml: bool) -> str:
        """A value as JSON; in XML a string as its bare text and the rest as JSON (:func:`~.values.text_kinds`)."""
        if not xml:
            return self.json_rule(rule, schema if isinstance(schema, dict) else {})
        text, other = text_kinds(schema)
        alternatives = [self.text_rule(f"{rule}_text", text)] if text is not None else []
        if other is not None:
            alternatives.append(self.json_rule(f"{rule}_json", other))
        self.rules.append(f"{rule}: {' | '.join(alternatives)}")
        return rule

    def text_rule(self, rule: str, schema: Mapping[str, Any], trimmed: bool = False) -> str:
        """A string written as its bare text: one of its ``enum``, or a line without ``<`` (at most ``maxLength``).

        ``trimmed``: the family's reader strips a value, so the text neither begins nor ends with a space.
        """
        words = schema.get("enum", [schema["const"]] if "const" in schema else None)
        if words is not None:
            self.rules.append(f"{rule}: {' | '.join(json.dumps(str(v)) for v in words)}")
            return rule
        most = schema.get("maxLength")
        if trimmed:
            inner = rf"{{0,{int(most) - 2}}}" if isinstance(most, int) and most >= 2 else "*"
            body = rf"/[^<\s]([^<\n]{inner}[^<\s])?/" if not isinstance(most, int) or most >= 2 else r"/[^<\s]/"
        else:
            body = rf"/[^<\n]{{1,{int(most)}}}/" if isinstance(most, int) else r"/[^<\n]+/"
        self.rules.append(f"{rule}: {body}")
        return rule


def write_call(fmt: ToolFormat, name: str, arguments: Mapping[str, Any]) -> str:
    """One call in the family's syntax (what its forced grammar admits for these arguments)."""
    xml = "".join(
        f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n</parameter>\n"
        for k, v in arguments.items()
    )
    return fmt.call.format(
        name=name,
        name_json=json.dumps(name, ensure_ascii=False),
        arguments=json.dumps(dict(arguments), ensure_ascii=False),
        xml_parameters=xml,
        python_arguments=", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in arguments.items()),
        **write_slots(fmt.body_args, arguments),
    )


def write_calls(fmt: ToolFormat, calls: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """Several calls in the family's syntax, with its before/between/after."""
    return fmt.before + fmt.between.join(write_call(fmt, n, a) for n, a in calls) + fmt.after


def check_names(fmt: ToolFormat, tools: Sequence[Mapping[str, Any]]) -> None:
    """Refuse a tool whose name or argument names ``fmt`` cannot write so that its own reader reads them back.

    Each tool's call is written as the grammar writes it and read back: a name or key holding the format's own
    delimiters (a space or ``(`` in a pythonic name, ``>`` in an XML one) would make every call to it invalid.

    Raises:
        InvalidSettingsError: naming the tool, the format and what did not read back.
    """
    table = replace(fmt, response_template=None)  # the entry writes calls and reads them back; a checkpoint's own
    for tool in tools:  # response template reads the model's free replies, in a syntax of its own
        function = tool["function"]
        name = function["name"]
        keys = list((function.get("parameters") or {}).get("properties") or {})
        _, calls = read_reply(table, write_calls(table, [(name, dict.fromkeys(keys, 0))]), [tool])
        got = [(c.name, sorted(c.arguments or {})) for c in calls if c.error is None]
        if got != [(name, sorted(keys))]:
            why = calls[0].error if calls and calls[0].error else f"it reads back as {got}"
            raise InvalidSettingsError(
                f"the tool {name!r} (arguments {keys}) cannot be called in the {fmt.name} tool-call format this "
                f"model writes: its name or an argument name holds that format's own markup ({why}); "
                "rename it (letters, digits, '_' and '-').",
                param="tools",
            )


__all__ = ["MAX_PARALLEL", "check_names", "forced_call_grammar", "strict_schema", "write_call", "write_calls"]
