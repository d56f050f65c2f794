"""A message's content with images in their places, in Hugging Face's shape, whatever framework it came from.

A message without images keeps its content as text (every chat template reads that). A message with images
becomes parts, ``{"type": "text", "text": ...}`` and ``{"type": "image"}``, as vision models' templates expect
(each puts its image placeholder where the part is); the images themselves travel in the request's ``media``,
in the order their parts appear.

Example:
    >>> from exllama_integrations.contract.api import Media
    >>> media: list[Media] = []
    >>> content_of(["What is in ", Media(b"..."), "?"], media), len(media)
    ([{'type': 'text', 'text': 'What is in '}, {'type': 'image'}, {'type': 'text', 'text': '?'}], 1)
    >>> content_of(["just text"], media)
    'just text'
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..contract.api import Media


def content_of(pieces: Sequence[str | Media], media: list[Media]) -> str | list[dict[str, Any]]:
    """A message's content from its pieces in order; its images are appended to ``media``."""
    if not any(isinstance(p, Media) for p in pieces):
        return "".join(p for p in pieces if isinstance(p, str))
    parts: list[dict[str, Any]] = []
    for p in pieces:
        if isinstance(p, Media):
            parts.append({"type": "image"})
            media.append(p)
        elif p:
            parts.append({"type": "text", "text": p})
    return parts


__all__ = ["content_of"]
