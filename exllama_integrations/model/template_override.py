"""A chat template given in place of the model's own (``chat_template=``, ``serve --chat-template``): a file or text.

The value is the path of a file that holds a template when such a file exists (read within ``TEMPLATE_LIMIT``);
else it is the template's text, unless it looks like a path to a file that is not there, which is refused.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import InvalidSettingsError
from .files import TEMPLATE_LIMIT, read_text


def read_template_override(value: str | None) -> str | None:
    """``chat_template`` is the path of a file that holds a template, when such a file exists; else template text."""
    if value is None:
        return None
    if "\n" not in value and len(value) < 4096:
        path = Path(os.path.expanduser(value))
        try:
            is_file = path.is_file()
        except OSError:
            is_file = False
        if is_file:
            return read_text(path, "chat template file", TEMPLATE_LIMIT)
        if "{" not in value and ("/" in value or value.endswith((".jinja", ".j2", ".txt", ".json"))):
            raise InvalidSettingsError(f"chat_template {value!r} looks like a path, but no such file exists.")
    return value


__all__ = ["read_template_override"]
