"""Tool calls in each model family's own format: the table (data), one reader, one forced-call grammar.

:func:`find_format` picks a family's :class:`ToolFormat` from its chat template (or ``tool_format=``);
:class:`ReplyReader` reads its replies, streamed or whole, into text and :class:`ParsedToolCall` values;
:func:`forced_call_grammar` holds a forced reply to well-formed calls in the same syntax; :func:`write_calls`
writes calls as the family does; :class:`CallProgress` follows calls as they are written (their arguments as JSON
as they come). A checkpoint that declares its own ``response_template`` (tokenizer_config.json,
:func:`response_template_of`) has its replies read with transformers' parser over it instead of the table's.
"""

from .grammar import check_names, forced_call_grammar, strict_schema, write_call, write_calls
from .partial import partial_object
from .progress import CallProgress
from .reader import ParsedToolCall, ReplyReader, new_call_id, read_reply
from .response_template import response_template_of, template_details, without_template
from .spelling import spelled
from .table import FALLBACK, FORMATS, ToolFormat, find_format

__all__ = [
    "CallProgress",
    "FALLBACK",
    "FORMATS",
    "ParsedToolCall",
    "ReplyReader",
    "ToolFormat",
    "check_names",
    "find_format",
    "forced_call_grammar",
    "new_call_id",
    "partial_object",
    "read_reply",
    "response_template_of",
    "spelled",
    "strict_schema",
    "template_details",
    "without_template",
    "write_call",
    "write_calls",
]
