"""Typed errors, each saying what went wrong and what to do next, and the one table of their wire codes.

Every error class has a ``code`` (its name on the wire) and an HTTP ``status``. :func:`error_to_wire`
and :func:`error_from_wire` carry an error across a process or a network and back as the same class,
with its message and its fields (``ContextLengthError.prompt_tokens`` ...), so a client catches exactly
what the server's runtime raised.
"""

from __future__ import annotations

from typing import Any, ClassVar


class ExLlamaIntegrationsError(Exception):
    """Base class of every error this package raises on purpose."""

    code: ClassVar[str] = "exllama_error"
    """The error's name on the wire (and in OpenAI error objects' ``code``)."""
    status: ClassVar[int] = 500
    """The HTTP status a server answers it with."""
    param: str | None = None
    """The request field at fault, when there is one."""

    def wire_fields(self) -> dict[str, Any]:
        """The error's own fields, as plain values (what crosses the wire beside the message)."""
        return {k: v for k, v in vars(self).items() if not k.startswith("_") and _plain(v)}


def _plain(v: Any) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


class MissingDependencyError(ExLlamaIntegrationsError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""

    code = "missing_dependency"

    def __init__(self, package: str, extra: str, purpose: str = "") -> None:
        self.package = package
        self.extra = extra
        what = f" (needed for {purpose})" if purpose else ""
        super().__init__(
            f"`{package}` is not installed{what}. Install it with `pip install 'exllama-integrations[{extra}]'`."
        )


class ModelLoadError(ExLlamaIntegrationsError):
    """A model directory could not be loaded."""

    code = "model_load_error"


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """The model directory does not exist or is not a directory (or a server does not serve that model)."""

    code = "model_not_found"
    status = 404


class InvalidModelError(ModelLoadError, ValueError):
    """The model directory exists but is incomplete or malformed (config, weights, tokenizer)."""

    code = "invalid_model"
    status = 400


class UnsupportedModelError(ModelLoadError, ValueError):
    """The model's architecture or shape is not supported by the chosen backend."""

    code = "unsupported_model"
    status = 400


class UnsupportedTaskError(UnsupportedModelError):
    """The model cannot do what was asked of it: a chat model asked to embed, an embedding model asked to chat."""

    code = "unsupported_task"
    status = 400


class BackendUnavailableError(ExLlamaIntegrationsError, RuntimeError):
    """The chosen backend cannot run here (library missing, no CUDA, known-broken stack)."""

    code = "backend_unavailable"
    status = 503


class RuntimeClosedError(ExLlamaIntegrationsError, RuntimeError):
    """The runtime was closed; build a new wrapper or runtime to load the model again."""

    code = "runtime_closed"
    status = 503


class InvalidSettingsError(ExLlamaIntegrationsError, ValueError):
    """Generation settings or a request's arguments are invalid."""

    code = "invalid_request"
    status = 400

    def __init__(self, message: str, param: str | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        if param is not None:
            self.param = param
        if reason is not None:
            self.reason = reason

    reason: str | None = None
    """A finer name for what is wrong (``unsupported_parameter``, ``max_tokens_too_large``), for OpenAI's ``code``."""


class ContextLengthError(ExLlamaIntegrationsError, ValueError):
    """Prompt plus requested new tokens do not fit the model's context."""

    code = "context_length_exceeded"
    status = 400

    def __init__(self, prompt_tokens: int, max_new_tokens: int, context_length: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.context_length = context_length
        super().__init__(
            f"prompt is {prompt_tokens} tokens and max_new_tokens is {max_new_tokens}, "
            f"but the context is {context_length} tokens. Shorten the prompt, lower max_new_tokens, "
            "or pass truncate_prompt=True to keep the end of the prompt."
        )


class InputTooLongError(ContextLengthError):
    """An input to embed or rerank is longer than the model reads (refused unless truncation was asked for)."""

    code = "input_too_long"
    status = 400

    def __init__(self, index: int, tokens: int, limit: int, model: str = "the model") -> None:
        self.input_index = index
        self.prompt_tokens = tokens
        self.max_new_tokens = 0
        self.context_length = limit
        self.param = "input"
        Exception.__init__(
            self,
            f"input {index} is {tokens} tokens, but {model} reads at most {limit}; shorten it, or ask for "
            f'truncation (truncate=True; the HTTP endpoints\' "truncate": true) to keep its first {limit} tokens.',
        )


class ConstraintError(ExLlamaIntegrationsError, ValueError):
    """A JSON schema, regex or grammar constraint could not be compiled."""

    code = "invalid_grammar"
    status = 400


class ConstraintViolationError(ExLlamaIntegrationsError, RuntimeError):
    """Constrained output was cut short (e.g. by max_new_tokens) before the grammar was complete."""

    code = "constraint_violation"
    status = 400


class ChatTemplateError(InvalidModelError):
    """The model's chat template failed to render, did something its sandbox forbids, or ran out of budget."""

    code = "chat_template_error"
    status = 400


class MediaError(InvalidSettingsError):
    """An image (or other medium) was refused: unreadable, too large, of a kind not taken, or the model takes none."""

    code = "invalid_media"
    status = 400


class GenerationError(ExLlamaIntegrationsError, RuntimeError):
    """The backend failed while generating (not caused by the request); the cause is chained."""

    code = "generation_error"


class EngineUnavailableError(GenerationError):
    """The engine process that runs the model died, or is starting again: retry in a moment (HTTP 503).

    The generations it held end with this error; ``/health`` says which, and why.
    """

    code = "engine_unavailable"
    status = 503


class ServerError(ExLlamaIntegrationsError, RuntimeError):
    """A server could not be reached, or answered with an error that is not the request's fault."""

    code = "server_error"
    status = 502

    def __init__(self, message: str, status: int | None = None) -> None:
        self.http_status = status
        super().__init__(message)


class ServerBusyError(ServerError):
    """The server's queue is full (HTTP 503); retry after a moment, or add replicas."""

    code = "server_overloaded"
    status = 503


class ModelUnavailableError(ServerError):
    """A served model cannot take the request now (HTTP 503); the message says why and what to do.

    No room to load it within the server's memory budget (``problem="no_room"``), or its load failed
    (``problem="load_failed"``). The server's other models go on serving; ``/v1/models`` shows each model's state.
    """

    code = "model_unavailable"
    status = 503

    def __init__(self, message: str, model: str | None = None, problem: str | None = None) -> None:
        super().__init__(message, self.status)
        self.model = model
        self.problem = problem
        self.param = "model"


class ProtocolError(ServerError):
    """A server sent something this client cannot read (not our wire form, too large, or cut short)."""

    code = "protocol_error"
    status = 502


ERRORS: dict[str, type[ExLlamaIntegrationsError]] = {
    cls.code: cls
    for cls in (
        ExLlamaIntegrationsError,
        MissingDependencyError,
        ModelLoadError,
        ModelNotFoundError,
        InvalidModelError,
        UnsupportedModelError,
        UnsupportedTaskError,
        BackendUnavailableError,
        RuntimeClosedError,
        InvalidSettingsError,
        ContextLengthError,
        InputTooLongError,
        ConstraintError,
        ConstraintViolationError,
        ChatTemplateError,
        MediaError,
        GenerationError,
        EngineUnavailableError,
        ServerError,
        ServerBusyError,
        ModelUnavailableError,
        ProtocolError,
    )
}
"""Every error class by its wire code: the one table, read in both directions."""


def error_to_wire(e: ExLlamaIntegrationsError) -> dict[str, Any]:
    """An error as plain data: ``{"code", "message", "fields"}``."""
    return {"code": type(e).code, "message": str(e), "fields": e.wire_fields()}


def error_from_wire(data: Any, status: int | None = None) -> ExLlamaIntegrationsError:
    """The error a wire form stands for, as its own class (an unknown code becomes a :class:`ServerError`)."""
    if not isinstance(data, dict):
        return ProtocolError(f"an error arrived in a form this client cannot read: {str(data)[:200]!r}", status)
    message = str(data.get("message") or "")[:4000]
    cls = ERRORS.get(str(data.get("code")))
    if cls is None:
        return ServerError(f"the server answered {status or 'an error'}: {message}", status)
    e = cls.__new__(cls)
    Exception.__init__(e, message)
    fields = data.get("fields")
    if isinstance(fields, dict):
        for k, v in fields.items():
            if isinstance(k, str) and not k.startswith("_") and _plain(v):
                setattr(e, k, v)
    if isinstance(e, ServerError) and getattr(e, "http_status", None) is None:
        e.http_status = status
    return e
