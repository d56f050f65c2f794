"""What crosses between a runtime and its engine process: backend requests in, token steps out, as JSON frames.

The cut is the backend contract (:mod:`~exllama_integrations.backends.base`), as in vLLM's engine core: a
request is its prompt ids, resolved settings, stop ids, grammar (as data) and reasoning options; a step is its
token ids, finish, cached count, logprobs and error. Templates, tokenizing, detokenizing, stop strings and the
reasoning split stay in the runtime's process, so none of them runs on the engine's driver. The grammar is
compiled again in the engine (it masks and feeds it there) and its verdict comes back on the last step.

Steps travel batched: every step the engine produced since its last send, for every request, in one frame.
Images travel as raw pixels in frames of their own (no base64, no second decode).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from pydantic import TypeAdapter

from ...backends.base import BackendRequest, RawLogprob, TokenStep
from ...contract.api import Grammar, Reasoning
from ...contract.settings import GenerationSettings
from ...errors import ExLlamaIntegrationsError, GenerationError, ProtocolError, error_from_wire, error_to_wire

logger = logging.getLogger(__name__)
_GRAMMAR = TypeAdapter(Grammar)
_REASONING = TypeAdapter(Reasoning)

MAX_FRAME_BYTES = 256 * 2**20
"""Largest frame either side reads (a request with images' pixels is the largest)."""


def pack(message: dict[str, Any]) -> bytes:
    """A message as one JSON frame."""
    return json.dumps(message, separators=(",", ":"), ensure_ascii=False).encode()


def unpack(frame: bytes) -> dict[str, Any]:
    """One JSON frame as a message.

    Raises:
        ProtocolError: not a JSON object, or too large.
    """
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"an engine frame of {len(frame)} bytes, more than the {MAX_FRAME_BYTES} allowed.")
    try:
        message = json.loads(frame)
    except (ValueError, RecursionError) as e:
        raise ProtocolError(f"an engine frame this side cannot read: {e}") from None
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise ProtocolError("an engine frame without an 'op'.")
    return message


def receive(socket: Any, who: str) -> tuple[dict[str, Any], list[bytes]] | None:
    """The next message on a socket (waits for it) and its extra frames; None (logged) for one ``who`` cannot read."""
    frames = socket.recv_multipart()
    try:
        return unpack(frames[0]), frames[1:]
    except ExLlamaIntegrationsError:
        logger.warning("%s dropped a frame it cannot read", who, exc_info=True)
        return None


def request_to_wire(rid: int, request: BackendRequest, media: str | None) -> dict[str, Any]:
    """A backend request as data (``media``: the engine's handle of its encoded images)."""
    steering = request.steering
    return {
        "rid": rid,
        "prompt_ids": request.prompt_ids,
        "settings": request.settings.model_dump(mode="json"),
        "max_new_tokens": request.max_new_tokens,
        "stop_token_ids": sorted(request.stop_token_ids),
        "grammar": None if request.grammar is None else _GRAMMAR.dump_python(request.grammar, mode="json"),
        "reasoning": None if steering is None else _REASONING.dump_python(steering.reasoning, mode="json"),
        "reasoning_end_ids": None if steering is None else list(steering.end_ids),
        "media": media,
        "cancelled": request.cancel.is_set(),
    }


def settings_from_wire(data: dict[str, Any]) -> GenerationSettings:
    """The settings of a request from the wire."""
    return GenerationSettings.model_validate(data)


def grammar_from_wire(data: Any) -> Grammar | None:
    """The grammar of a request from the wire."""
    return None if data is None else _GRAMMAR.validate_python(data)


def reasoning_from_wire(data: Any) -> Reasoning | None:
    """The reasoning options of a request from the wire."""
    return None if data is None else _REASONING.validate_python(data)


def error_wire(e: BaseException, backend: str) -> dict[str, Any]:
    """Any exception as a typed error's data (an untyped one as the GenerationError the runtime would make)."""
    if not isinstance(e, ExLlamaIntegrationsError):
        e = GenerationError(f"the {backend} backend failed: {type(e).__name__}: {e}")
    return error_to_wire(e)


def step_to_wire(rid: int, step: TokenStep, backend: str) -> list[Any]:
    """One step as a row: ``[rid, ids, finish, cached, accepting, logprobs, error, prompt_logprobs, drafted]``.

    The last two only where set.
    """
    logprobs = _raw_rows(step.logprobs)
    error = None if step.error is None else error_wire(step.error, backend)
    row = [rid, list(step.token_ids), step.finish, step.cached, step.accepting, logprobs, error]
    if step.drafted is not None:
        return [*row, _raw_rows(step.prompt_logprobs), list(step.drafted)]
    return row if step.prompt_logprobs is None else [*row, _raw_rows(step.prompt_logprobs)]


def _raw_rows(lps: tuple[RawLogprob, ...] | None) -> list[Any] | None:
    return None if lps is None else [[lp.token_id, lp.logprob, [list(t) for t in lp.top]] for lp in lps]


def _raw_from_rows(rows: Any) -> tuple[RawLogprob, ...] | None:
    if rows is None:
        return None
    return tuple(RawLogprob(int(t), float(v), tuple((int(a), float(b)) for a, b in top)) for t, v, top in rows)


def step_from_wire(row: Any) -> tuple[int, TokenStep]:
    """A row back as (rid, step).

    Raises:
        ProtocolError: a row of another shape.
    """
    try:
        rid, ids, finish, cached, accepting, logprobs, error, *rest = row
        drafted = None if len(rest) < 2 else (int(rest[1][0]), int(rest[1][1]))
        return int(rid), TokenStep(
            tuple(int(t) for t in ids),
            _raw_from_rows(logprobs),
            finish,
            None if error is None else error_from_wire(error),
            cached,
            accepting,
            _raw_from_rows(rest[0]) if rest else None,
            drafted,
        )
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"an engine step this side cannot read: {e}") from None
