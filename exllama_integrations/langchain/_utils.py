"""What the LangChain classes share: building/borrowing the runtime and merging generation params."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from ..errors import InvalidSettingsError
from ..runtime import ExLlamaRuntime, GenerationSettings
from ..runtime.settings import SAMPLING_FIELDS, call_overrides

# Fields that are generation settings, in the order they are merged.
SETTING_FIELDS = (*SAMPLING_FIELDS, "logprobs")


class ExLlamaRuntimeMixin(BaseModel):
    """Fields and helpers shared by ExLlamaLLM and ChatExLlama (not a LangChain class by itself)."""

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True, protected_namespaces=())

    model_dir: str | None = None
    """Model directory (config.json, safetensors or EXL3 weights, tokenizer). Or pass ``runtime``."""
    backend: str = "auto"
    """``auto`` (exllamav3 on CUDA, else the CPU reference), ``exllamav3``, ``exllama``, ``transformers``."""
    runtime: ExLlamaRuntime | None = Field(default=None, exclude=True)
    """An already loaded runtime to use instead of ``model_dir``."""
    shared_runtime: bool = True
    """Reuse the runtime already loaded for this directory and options (True), or load a private one."""
    max_seq_len: int | None = None
    """Context (cache) length to allocate; None: the model's, capped by the backend's default."""
    dtype: str | None = None
    """Weights dtype for backends that take one (CPU reference: float32 by default)."""
    device: str | None = None
    """Device for backends that take one (``cpu``, ``cuda:0``)."""
    backend_options: dict[str, Any] = Field(default_factory=dict)
    """Backend-specific load options (exllamav3: ``cache_bits``, ``gpu_split``; exllama: ``lora_dir``)."""

    max_new_tokens: int | None = Field(default=None, alias="max_tokens")
    """Most tokens to generate (``max_tokens`` is accepted too); None: the runtime default (256)."""
    temperature: float | None = None
    """Sampling temperature; 0 is greedy; None: the runtime default (0.8)."""
    top_k: int | None = None
    """Top-k truncation; 0 disables."""
    top_p: float | None = None
    """Nucleus sampling mass; 1.0 disables."""
    min_p: float | None = None
    """Min-p truncation; 0 disables."""
    typical: float | None = None
    """Locally typical sampling mass; 1.0 disables."""
    repetition_penalty: float | None = None
    """Repetition penalty; 1.0 disables."""
    no_repeat_ngram_size: int | None = None
    """Never repeat an n-gram of this many tokens (breaks greedy loops of small models; not on exllamav3)."""
    seed: int | None = None
    """Sampling seed: the same seed and prompt reproduce the output."""
    stop: list[str] | None = None
    """Stop strings, merged with the ``stop`` of each call; never part of the output."""
    logprobs: int | None = None
    """Return log-probabilities with this many top alternatives per token (in generation info)."""

    _runtime: ExLlamaRuntime | None = PrivateAttr(default=None)

    def __init__(self, **data: Any) -> None:
        """Validate fields, then the generation settings, then load (or borrow) the runtime.

        Done after pydantic's validation so that our typed errors (InvalidSettingsError,
        ModelNotFoundError, ...) reach the caller as themselves, not wrapped in a ValidationError.
        """
        super().__init__(**data)
        if self.runtime is None and not self.model_dir:
            raise InvalidSettingsError("pass model_dir='path/to/model' or runtime=ExLlamaRuntime(...).")
        # Validate the generation fields once, at construction, with the same rules as every call.
        GenerationSettings().merged(**self._settings_overrides())
        if self.runtime is not None:
            self._runtime = self.runtime
        else:
            options = dict(max_seq_len=self.max_seq_len, dtype=self.dtype, device=self.device, **self.backend_options)
            factory = ExLlamaRuntime.shared if self.shared_runtime else ExLlamaRuntime
            assert self.model_dir is not None
            self._runtime = factory(self.model_dir, self.backend, **options)

    @property
    def exllama_runtime(self) -> ExLlamaRuntime:
        """The loaded runtime this wrapper uses."""
        assert self._runtime is not None
        return self._runtime

    @property
    def model_name(self) -> str:
        """The model directory's name."""
        return self.exllama_runtime.model_name

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` by the model's own tokenizer."""
        return self.exllama_runtime.encode(text)

    def get_num_tokens(self, text: str) -> int:
        """Number of tokens in ``text`` by the model's own tokenizer."""
        return self.exllama_runtime.count_tokens(text)

    def _settings_overrides(self, base_stop: Sequence[str] = (), **call_kwargs: Any) -> dict[str, Any]:
        """Instance fields, then per-call kwargs (unknown ones refused); never mutates the instance."""
        unknown = set(call_kwargs) - set(GenerationSettings.model_fields) - _IGNORED_CALL_KWARGS - {"max_tokens"}
        if unknown:
            raise InvalidSettingsError(f"unknown generation argument(s): {', '.join(sorted(unknown))}.")
        return call_overrides({k: getattr(self, k) for k in SETTING_FIELDS}, call_kwargs, base_stop)

    def _generate_params(self, stop: list[str] | None = None, **kwargs: Any) -> GenerationSettings:
        """Settings for one call: runtime defaults < instance fields < call kwargs; stops unioned."""
        overrides = self._settings_overrides([*(self.stop or []), *(stop or [])], **kwargs)
        return self.exllama_runtime.resolve_settings(None, **overrides)

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "backend": self.exllama_runtime.backend_name,
            **{k: getattr(self, k) for k in SETTING_FIELDS if getattr(self, k) is not None},
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> Any:
        """LangSmith tracing params, from the settings a call with these arguments would run with."""
        params = super()._get_ls_params(stop=stop, **kwargs)  # type: ignore[misc]  # BaseLLM / BaseChatModel
        s = self._generate_params(
            stop, **{k: v for k, v in kwargs.items() if k in GenerationSettings.model_fields or k == "max_tokens"}
        )
        params.update(
            ls_provider="exllama",
            ls_model_name=kwargs.get("model") or self.model_name,
            ls_temperature=s.temperature,
            ls_max_tokens=s.max_new_tokens,
        )
        if s.stop:
            params["ls_stop"] = s.stop
        return params


# Arguments LangChain passes that are not generation settings (accepted and ignored here).
_IGNORED_CALL_KWARGS = {"timeout", "max_retries", "streaming", "callbacks", "tags", "metadata", "run_name"}
