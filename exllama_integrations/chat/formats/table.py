"""Each model family's tool-call format, as data: one table entry a family.

An entry says how a reply of that family is read (what opens and closes a call, what the body between them
holds, which markup is neither text nor call) and how one call is written (``call``: the same text is the
forced-call grammar, with the tool's name and its argument schema in the slots, and what the fallback history
writes). It is the declarative shape of transformers' ``response_template`` (regions that open and close on
literals, a content kind for the body) reduced to what a stream can be read with literal markers, plus the
writing side that a response template does not carry. A new family is a new entry; the reader
(:mod:`.reader`) and the grammar (:mod:`.grammar`) are the same for all.

Body kinds (how the text between ``opens`` and ``closes`` becomes calls):

- ``json``: one ``{"name": ..., "arguments"|"parameters": {...}}`` object (Hermes, Qwen);
- ``json-list``: a JSON list of such objects, or one (Mistral v3, Phi-4-mini, Granite);
- ``json-seq``: such objects separated by ``;`` (Llama 3.x);
- ``pattern``: a regular expression with the groups ``name`` and ``arguments`` (a JSON object): Mistral v11's
  ``NAME[ARGS]{...}``, DeepSeek's ``function<｜tool▁sep｜>NAME ```json ...````, harmony's ``to=functions.NAME``;
- ``xml``: ``<function=NAME><parameter=KEY>VALUE</parameter>...</function>`` (Qwen3-Coder), values read by the
  tool's schema;
- ``python``: ``[f(a=1), g(b="x")]`` (Llama 4, Llama 3.2 pythonic);
- ``tagged``: calls and parameters in tags of the family's own (GLM-4.5's and Hy3's ``<arg_key>``/``<arg_value>``,
  MiniMax-M2's, DeepSeek's and Muse Glimmer's ``<invoke name=..>``/``<parameter name=..>``), described by literals in
  ``body_args`` (``invoke``: a call's open, name end and close; ``sep``, ``wrap``, ``header``), parameters read and
  written as its ``write_param`` writes them, scanned in one pass (:mod:`.markup`);
- ``gemma``: Gemma 4's ``call:NAME{key:<|"|>text<|"|>,...}`` (:mod:`.tagged`).

``call`` is a string with slots: ``{name}`` (the bare name), ``{name_json}`` (the name as a JSON string),
``{arguments}`` (the arguments as a JSON object), ``{xml_parameters}``, ``{python_arguments}``,
``{tagged_parameters}``, ``{gemma_arguments}``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ...errors import InvalidSettingsError
from .response_template import parser_available, template_markup
from .spelling import spelled

SPECIAL_SHAPE = re.compile(r"(<\|[^|<>]{1,40}\|>|<｜[^｜]{1,40}｜>|\[[A-Z_/]{2,30}\])")
"""What a control token of these families looks like (``<|message|>``, ``<｜tool▁sep｜>``, ``[ARGS]``)."""


@dataclass(frozen=True)
class ToolFormat:
    """How one family writes tool calls: read (opens, closes, body, strip) and written (call, between)."""

    name: str
    markers: tuple[str, ...]
    """All of these in a chat template pick this format (entries are tried in table order)."""
    opens: tuple[str, ...]
    """Literals that open a call region."""
    body: str
    """How the region's text becomes calls (see the module docstring)."""
    call: str
    """One call as the family writes it, with slots (see the module docstring)."""
    closes: tuple[str, ...] = ()
    """Literals that close a region; none: the region runs to the next open or the end of the reply."""
    at_start: bool = False
    """The opens count only at the start of the reply (a bare JSON or list reply); later they are text."""
    looks_like: str | None = None
    """For ``at_start`` formats: a reply is read as calls only if its start matches this regex."""
    strip: tuple[str, ...] = ()
    """Markup that is neither text nor call (harmony's channel headers): dropped from the text."""
    body_args: Mapping[str, Any] = field(default_factory=dict)
    """The body's parameters: ``pattern`` (for ``pattern``), ``keys`` (argument keys for the JSON bodies),
    ``text`` (a regex: a region whose body matches it is answer text, its group ``text``)."""
    before: str = ""
    """Written once before the calls (Mistral's ``[TOOL_CALLS][``)."""
    between: str = ""
    """Written between two calls."""
    after: str = ""
    """Written once after the calls."""
    parallel: bool = True
    """Whether a reply may hold several calls."""
    ids: str = "openai"
    """Call ids: ``openai`` (``call_`` + 24 hex) or ``alnum9`` (9 letters and digits, which Mistral checks); ``kimi``:
    ``call_`` ids at the API, ``functions.NAME:N`` in the history the template sees."""
    thinking: tuple[str, str] | None = None
    """The family's own thinking delimiters, where they are not a ``<think>`` pair found in the template."""
    history_arguments: str = "object"
    """How an earlier turn's call arguments reach the template: ``object`` (as most templates iterate them) or
    ``json`` (text: DeepSeek-V3.1's template joins them to its markup with ``+``)."""
    tokens: tuple[str, ...] = ()
    """Control tokens inside the markup that no other field names whole (DeepSeek's ``｜DSML｜``): the forced
    grammar writes them as the tokens they are."""
    response_template: Mapping[str, Any] | None = None
    """The checkpoint's own ``response_template`` (tokenizer_config.json): replies are read with transformers'
    parser over it (:mod:`.response_template`); the rest of the entry still writes calls."""
    prompt_tail: str = ""
    """What the generation prompt ends with that the reply's first message continues (Muse Glimmer's
    ``<|start|>assistant``, whose header the reply completes): the reader reads the reply as following it."""

    @property
    def markup(self) -> tuple[str, ...]:
        """Every literal of the format and the control tokens inside them: what a reply must show as text."""
        parts = [*self.opens, *self.closes, *self.strip, self.before, self.between, self.after, *self.tokens]
        if self.thinking:
            parts += list(self.thinking)
        if self.response_template is not None:
            parts += list(template_markup(self.response_template))
        pieces = [p for part in [*parts, self.call] for p in SPECIAL_SHAPE.findall(part)]
        return tuple(p for p in dict.fromkeys([*parts, *pieces]) if p)


_JSON_CALL = '{{"name": {name_json}, "arguments": {arguments}}}'

FORMATS: dict[str, ToolFormat] = {
    f.name: f
    for f in (
        ToolFormat(
            "harmony",
            markers=("<|channel|>", "commentary"),
            opens=("<|channel|>commentary",),
            closes=("<|call|>", "<|end|>"),
            body="pattern",
            body_args={
                "pattern": r"^\s*to=(?:functions\.)?(?P<name>[^\s<]+)\s*(?:<\|constrain\|>\s*(?:\w+\s*)?)?"
                r"<\|message\|>(?P<arguments>.*)$",
                "text": r"^\s*<\|message\|>(?P<text>.*)$",  # a commentary preamble, addressed to no tool
            },
            strip=("<|start|>assistant", "<|channel|>final<|message|>", "<|end|>", "<|return|>"),
            call="<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{arguments}"
            "<|call|>",
            parallel=False,
            thinking=("<|channel|>analysis<|message|>", "<|end|>"),
        ),
        ToolFormat(
            "hy3",  # Tencent Hy3 (hy_v3): GLM's key/value pairs in tokens suffixed ":opensource", in one block
            markers=("<tool_calls:opensource>", "<tool_sep:opensource>"),
            opens=("<tool_calls:opensource>",),
            closes=("</tool_calls:opensource>",),
            body="tagged",
            body_args={
                "invoke": ("<tool_call:opensource>", None, "</tool_call:opensource>"),
                "sep": "<tool_sep:opensource>",
                "write_param": "<arg_key:opensource>{key}</arg_key:opensource>\n<arg_value:opensource>{value}"
                "</arg_value:opensource>\n",
            },
            call="<tool_call:opensource>{name}<tool_sep:opensource>\n{tagged_parameters}</tool_call:opensource>\n",
            before="<tool_calls:opensource>\n",
            after="</tool_calls:opensource>",
            tokens=(
                "<tool_call:opensource>",
                "</tool_call:opensource>",
                "<tool_sep:opensource>",
                "<arg_key:opensource>",
                "</arg_key:opensource>",
                "<arg_value:opensource>",
                "</arg_value:opensource>",
            ),
            thinking=("<think:opensource>", "</think:opensource>"),
        ),
        ToolFormat(
            "glm45",
            markers=("<tool_call>", "<arg_key>"),
            opens=("<tool_call>",),
            closes=("</tool_call>",),
            body="tagged",
            body_args={
                "invoke": ("", None, ""),  # the region is one call: its name, then its parameters
                "write_param": "<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>\n",
            },
            call="<tool_call>{name}\n{tagged_parameters}</tool_call>",
            between="\n",
            tokens=("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
        ),
        ToolFormat(
            "minimax_m2",
            markers=("<minimax:tool_call>",),
            opens=("<minimax:tool_call>",),
            closes=("</minimax:tool_call>",),
            body="tagged",
            body_args={
                "invoke": ('<invoke name="', '">', "</invoke>"),
                "write_param": '<parameter name="{key}">{value}</parameter>\n',
            },
            call='<invoke name="{name}">\n{tagged_parameters}</invoke>\n',
            before="<minimax:tool_call>\n",
            after="</minimax:tool_call>",
        ),
        ToolFormat(
            "deepseek_v4",
            markers=("｜DSML｜",),
            opens=("<｜DSML｜tool_calls>", "<｜DSML｜function_calls>"),  # V4, V3.2
            closes=("</｜DSML｜tool_calls>", "</｜DSML｜function_calls>"),
            body="tagged",
            body_args={
                "invoke": ('<｜DSML｜invoke name="', '">', "</｜DSML｜invoke>"),
                "write_param": '<｜DSML｜parameter name="{key}" string="{string}">{value}</｜DSML｜parameter>\n',
            },
            call='<｜DSML｜invoke name="{name}">\n{tagged_parameters}</｜DSML｜invoke>\n',
            before="<｜DSML｜tool_calls>\n",
            after="</｜DSML｜tool_calls>",
            tokens=("｜DSML｜",),
        ),
        ToolFormat(
            "gemma4",
            markers=("<|tool_call>", "<tool_call|>"),
            opens=("<|tool_call>",),
            closes=("<tool_call|>",),
            body="gemma",
            body_args={"call": r"^\s*call:(?P<name>[\w.-]+)\s*(?P<params>\{.*\})\s*$"},
            call="<|tool_call>call:{name}{gemma_arguments}<tool_call|>",
            tokens=('<|"|>',),
            thinking=("<|channel>thought", "<channel|>"),
        ),
        ToolFormat(
            "muse_glimmer",  # messages addressed to a recipient: to=self thinks, to=user answers, to=NAME calls
            markers=("<atem:function_calls>", "<|message|>"),
            opens=("<|start|>assistant to=",),
            closes=("<|eom|>",),
            body="tagged",
            body_args={
                "invoke": ('<atem:invoke name="', '">', "</atem:invoke>"),
                "wrap": ("<atem:function_calls>", "</atem:function_calls>"),
                "header": "<|message|>",  # the recipient's header: NAME<|message|>, then the wrap
                "write_param": '<atem:parameter name="{key}">{value}</atem:parameter>\n',
                "strip": False,  # "spaces for string values are not stripped" (its system prompt)
                "text": r"^\s*(?:(?:self|user)\s*)?<\|message\|>(?P<text>.*)$",  # a message to itself or the user
            },
            strip=(
                "<|start|>assistant to=user<|message|>",
                "<|start|>assistant<|message|>",
                "<|start|>assistant",
                "<|eom|>",
            ),
            call=' to={name}<|message|><atem:function_calls>\n<atem:invoke name="{name}">\n{tagged_parameters}'
            "</atem:invoke>\n</atem:function_calls>",
            between="<|eom|><|start|>assistant",
            thinking=("to=self<|message|>", "<|eom|>"),
            prompt_tail="<|start|>assistant",
        ),
        ToolFormat(
            "qwen3_coder",
            markers=("<tool_call>", "<function="),
            opens=("<tool_call>",),
            closes=("</tool_call>",),
            body="xml",
            call="<tool_call>\n<function={name}>\n{xml_parameters}</function>\n</tool_call>",
            between="\n",
        ),
        ToolFormat(
            "hermes",
            markers=("<tool_call>",),
            opens=("<tool_call>",),
            closes=("</tool_call>",),
            body="json",
            call="<tool_call>\n" + _JSON_CALL + "\n</tool_call>",
            between="\n",
        ),
        ToolFormat(
            "mistral_v11",
            markers=("[TOOL_CALLS]", "[ARGS]"),
            opens=("[TOOL_CALLS]",),
            body="pattern",
            body_args={"pattern": r"^\s*(?P<name>[^\s\[]+)\s*\[ARGS\](?P<arguments>.*)$"},
            call="[TOOL_CALLS]{name}[ARGS]{arguments}",
            ids="alnum9",  # Mistral Small 3.2's template checks the ids of the calls in a history
            thinking=("[THINK]", "[/THINK]"),
        ),
        ToolFormat(
            "mistral",
            markers=("[TOOL_CALLS]",),
            opens=("[TOOL_CALLS]",),
            body="json-list",
            call=_JSON_CALL,
            before="[TOOL_CALLS][",
            between=", ",
            after="]",
            ids="alnum9",
        ),
        ToolFormat(
            "nemotron",
            markers=("<TOOLCALL>",),
            opens=("<TOOLCALL>",),
            closes=("</TOOLCALL>",),
            body="json-list",
            call=_JSON_CALL,
            before="<TOOLCALL>[",
            between=", ",
            after="]</TOOLCALL>",
        ),
        ToolFormat(
            "phi4_mini",
            markers=("<|tool_call|>", "<|/tool_call|>"),
            opens=("<|tool_call|>",),
            closes=("<|/tool_call|>",),
            body="json-list",
            call=_JSON_CALL,
            before="<|tool_call|>[",
            between=", ",
            after="]<|/tool_call|>",
        ),
        ToolFormat(
            "granite",
            markers=("<|tool_call|>",),
            opens=("<|tool_call|>",),
            body="json-list",
            call=_JSON_CALL,
            before="<|tool_call|>[",
            between=", ",
            after="]",
        ),
        ToolFormat(
            "deepseek_v3",
            markers=("<｜tool▁calls▁begin｜>", "```json"),
            opens=("<｜tool▁call▁begin｜>",),
            closes=("<｜tool▁call▁end｜>",),
            body="pattern",
            body_args={
                "pattern": r"^\s*(?:\w+)?<｜tool▁sep｜>(?P<name>[^\n]+)\n\s*```(?:json)?"
                r"(?P<arguments>.*)```\s*$"  # (no lazy group before a run of spaces: one look at each)
            },
            strip=("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
            call="<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{arguments}\n```<｜tool▁call▁end｜>",
            before="<｜tool▁calls▁begin｜>",
            after="<｜tool▁calls▁end｜>",
        ),
        ToolFormat(
            "deepseek_v31",
            markers=("<｜tool▁calls▁begin｜>",),
            opens=("<｜tool▁call▁begin｜>",),
            closes=("<｜tool▁call▁end｜>",),
            body="pattern",
            body_args={"pattern": r"^\s*(?P<name>[^<\s][^<\n]*)(?:\n\s*)?<｜tool▁sep｜>(?P<arguments>.*)$"},
            strip=("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
            call="<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{arguments}<｜tool▁call▁end｜>",
            history_arguments="json",
            before="<｜tool▁calls▁begin｜>",
            after="<｜tool▁calls▁end｜>",
        ),
        ToolFormat(
            "kimi_k2",
            markers=("<|tool_calls_section_begin|>",),
            opens=("<|tool_call_begin|>",),
            closes=("<|tool_call_end|>",),
            body="pattern",
            body_args={
                "pattern": r"^\s*(?:functions\.)?(?P<name>[^\s:<]+)(?::\d+)?\s*<\|tool_call_argument_begin\|>"
                r"(?P<arguments>.*)$"
            },
            strip=("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
            call="<|tool_call_begin|>functions.{name}:0<|tool_call_argument_begin|>{arguments}<|tool_call_end|>",
            before="<|tool_calls_section_begin|>",
            after="<|tool_calls_section_end|>",
            ids="kimi",
        ),
        ToolFormat(
            "pythonic",
            markers=("[func_name1(",),
            opens=("[",),
            at_start=True,
            looks_like=r"^\s*\[\s*[^\s()\[\]{}=,'\"]+\(",  # any name the reader reads: get-weather, météo
            body="python",
            call="{name}({python_arguments})",
            before="[",
            between=", ",
            after="]",
        ),
        ToolFormat(
            "fallback",
            markers=(),
            opens=("<tool_call>",),
            closes=("</tool_call>",),
            body="json",
            call="<tool_call>" + _JSON_CALL + "</tool_call>",
            parallel=False,  # the fallback prompt asks for one call ("reply with only ...")
        ),
        ToolFormat(
            "llama3_json",
            markers=("<|start_header_id|>", '"parameters"'),
            opens=("<|python_tag|>", "{"),
            at_start=True,
            looks_like=r'^\s*(?:<\|python_tag\|>\s*)?\{\s*"(?:name|type)"',
            body="json-seq",
            body_args={"keys": ("parameters", "arguments")},
            call='{{"name": {name_json}, "parameters": {arguments}}}',
            between="; ",
        ),
    )
}
"""The table, in the order a chat template is matched against ``markers``."""

FALLBACK = "fallback"
"""The format a model without one of its own is asked to write (the documented fallback prompt: Hermes'
``<tool_call>`` without its newlines, as the prompt shows it)."""


def find_format(
    template: str | None, override: str | None = None, response_template: Mapping[str, Any] | None = None
) -> ToolFormat:
    """The tool-call format of a chat template (``override``: a name from :data:`FORMATS`).

    A template that shows none of the families' markers gets :data:`FALLBACK`. ``response_template``: the
    model's own (:func:`~.response_template.response_template_of`): its replies are read with it, where
    transformers' parser is installed here.

    Raises:
        InvalidSettingsError: ``override`` names no format.
    """
    fmt = _find(template, override)
    if response_template is None or not parser_available():
        return fmt
    return replace(fmt, response_template=response_template)


def _find(template: str | None, override: str | None) -> ToolFormat:
    if override is not None:
        if override not in FORMATS:
            raise InvalidSettingsError(
                f"tool_format {override!r} is not one of {', '.join(FORMATS)}.", param="tool_format"
            )
        return FORMATS[override]
    template = spelled(template) if template else template
    for fmt in FORMATS.values():
        if template and fmt.markers and all(m in template for m in fmt.markers):
            return fmt
    return FORMATS[FALLBACK]


__all__ = ["FALLBACK", "FORMATS", "ToolFormat", "find_format"]
