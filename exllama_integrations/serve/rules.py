"""What every API of the server holds to alike: the finish check, the error statuses it documents, object ids.

Each API (``openai/``, ``responses/``, ``anthropic/``) answers in its own shapes, but a generation its runtime cut
is an error on all of them, and each route documents the same typed statuses (the one error table of
:mod:`exllama_integrations.errors` decides them).
"""

from __future__ import annotations

import uuid
from typing import Any

from ..errors import RuntimeClosedError

ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "a bad request (settings, context, grammar)"},
    401: {"description": "a missing or wrong API key"},
    404: {"description": "a model this server does not serve"},
    413: {"description": "a body over the server's limit"},
    503: {"description": "the server is full or its runtime was closed"},
}
"""The statuses an OpenAI-shaped route documents (its OpenAPI ``responses``)."""


def new_id(prefix: str) -> str:
    """An OpenAI-style object id."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def check_finish(native: str) -> None:
    """A generation cut by the server's own runtime (closed while it ran) is an error, never a quiet "stop".

    Raises:
        RuntimeClosedError: the runtime stopped the generation.
    """
    if native == "cancelled":
        raise RuntimeClosedError("the server's runtime stopped this generation before it ended (it is shutting down).")
