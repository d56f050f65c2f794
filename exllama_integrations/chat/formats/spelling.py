"""A chat template's tokens as it writes them, where it builds them with ``str.format`` (Hy3's template)."""

from __future__ import annotations

import re

_SET_STRING = re.compile(r"""\{%-?\s*set\s+(\w+)\s*=\s*(['"])([^'"{}]*)\2\s*-?%\}""")
_FORMATTED = re.compile(r"""(['"])([^'"{}]*)\{\}([^'"{}]*)\1\.format\(\s*(\w+)\s*\)""")


def spelled(template: str) -> str:
    """``template`` with ``'<x{}>'.format(V)`` written out where ``V`` is set to a string in it.

    Hy3's template builds each of its tokens so (``'<tool_calls{}>'.format(HYTK)`` with ``HYTK = ':opensource'``):
    its markers and thinking delimiters are looked for as the template writes them.
    """
    if ".format(" not in template:
        return template
    names = {m.group(1): m.group(3) for m in _SET_STRING.finditer(template)}

    def written(m: re.Match[str]) -> str:
        if m.group(4) not in names:
            return m.group(0)
        return m.group(1) + m.group(2) + names[m.group(4)] + m.group(3) + m.group(1)

    return _FORMATTED.sub(written, template)


__all__ = ["spelled"]
