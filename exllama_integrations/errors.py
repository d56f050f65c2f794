"""Typed errors. Each one says what went wrong and what to do next."""

from __future__ import annotations


class ExLlamaIntegrationsError(Exception):
    """Base class of every error this package raises on purpose."""


class MissingDependencyError(ExLlamaIntegrationsError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""

    def __init__(self, package: str, extra: str, purpose: str = "") -> None:
        self.package = package
        self.extra = extra
        what = f" (needed for {purpose})" if purpose else ""
        super().__init__(
            f"`{package}` is not installed{what}. Install it with `pip install 'exllama-integrations[{extra}]'`."
        )


class ModelLoadError(ExLlamaIntegrationsError):
    """A model directory could not be loaded."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """The model directory does not exist or is not a directory."""


class InvalidModelError(ModelLoadError, ValueError):
    """The model directory exists but is incomplete or malformed (config, weights, tokenizer)."""


class UnsupportedModelError(ModelLoadError, ValueError):
    """The model's architecture or shape is not supported by the chosen backend."""


class BackendUnavailableError(ExLlamaIntegrationsError, RuntimeError):
    """The chosen backend cannot run here (library missing, no CUDA, known-broken stack)."""


class RuntimeClosedError(ExLlamaIntegrationsError, RuntimeError):
    """The runtime was closed; build a new wrapper or runtime to load the model again."""


class InvalidSettingsError(ExLlamaIntegrationsError, ValueError):
    """Generation settings or a request's arguments are invalid."""


class ContextLengthError(ExLlamaIntegrationsError, ValueError):
    """Prompt plus requested new tokens do not fit the model's context."""

    def __init__(self, prompt_tokens: int, max_new_tokens: int, context_length: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.context_length = context_length
        super().__init__(
            f"prompt is {prompt_tokens} tokens and max_new_tokens is {max_new_tokens}, "
            f"but the context is {context_length} tokens. Shorten the prompt, lower max_new_tokens, "
            "or pass truncate_prompt=True to keep the end of the prompt."
        )


class ConstraintError(ExLlamaIntegrationsError, ValueError):
    """A JSON schema, regex or grammar constraint could not be compiled."""


class ConstraintViolationError(ExLlamaIntegrationsError, RuntimeError):
    """Constrained output was cut short (e.g. by max_new_tokens) before the grammar was complete."""


class ChatTemplateError(InvalidModelError):
    """The model's chat template failed to render, did something its sandbox forbids, or ran out of budget."""


class GenerationError(ExLlamaIntegrationsError, RuntimeError):
    """The backend failed while generating (not caused by the request); the cause is chained."""


class ServerError(ExLlamaIntegrationsError, RuntimeError):
    """A server could not be reached, or answered with an error that is not the request's fault."""

    def __init__(self, message: str, status: int | None = None) -> None:
        self.status = status
        super().__init__(message)


class ServerBusyError(ServerError):
    """The server's queue is full (HTTP 503); retry after a moment, or add replicas."""
