"""Tool calls in each model family's own format: the table (data), one reader, one forced-call grammar.

:func:`find_format` picks a family's :class:`ToolFormat` from its chat template (or ``tool_format=``);
:class:`ReplyReader` reads its replies, streamed or whole, into text and :class:`ParsedToolCall` values;
:func:`forced_call_grammar` holds a forced reply to well-formed calls in the same syntax; :func:`write_calls`
writes calls as the family does.
"""

from .grammar import forced_call_grammar, strict_schema, write_call, write_calls
from .reader import ParsedToolCall, ReplyReader, new_call_id, read_reply
from .table import FALLBACK, FORMATS, ToolFormat, find_format

__all__ = [
    "FALLBACK",
    "FORMATS",
    "ParsedToolCall",
    "ReplyReader",
    "ToolFormat",
    "find_format",
    "forced_call_grammar",
    "new_call_id",
    "read_reply",
    "strict_schema",
    "write_call",
    "write_calls",
]
