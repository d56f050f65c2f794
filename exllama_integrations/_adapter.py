"""The one configuration LangChain's and LlamaIndex's classes share: fields, the runtime they use, call settings.

Rules decided here, once, for every class:

* Where the model is: exactly one of ``model_dir=`` (load it in this process, shared), ``base_url=``
  (a server's model, through :class:`~exllama_integrations.serve.remote.RemoteRuntime`) or
  ``runtime=`` (any :class:`~exllama_integrations.runtime.api.Runtime`).
* Names: the framework's and HuggingFacePipeline's common names are accepted where they mean
  something (``max_tokens`` for ``max_new_tokens``, ``do_sample=False`` for greedy, a single
  ``stop`` string, ``logprobs=True`` + ``top_logprobs=k``); any other unknown name, in the constructor
  or per call, is an :class:`~exllama_integrations.errors.InvalidSettingsError` naming the closest match.
* Settings a backend cannot honour are refused when the class is built, not at the first token.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, ValidationError

from .errors import InvalidSettingsError
from .runtime._common import check_setting_names
from .runtime.api import Runtime
from .runtime.settings import SAMPLING_FIELDS, GenerationSettings

SETTING_FIELDS = SAMPLING_FIELDS
"""The generation settings that are also fields of the framework classes."""


def as_stops(stop: str | Iterable[str] | None) -> list[str]:
    """A call's or field's ``stop`` as a list: one string is one stop string, never its characters."""
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    return list(stop)


def normalize_call_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Framework names for settings, as settings (``max_tokens``, ``do_sample``, ``logprobs`` + ``top_logprobs``)."""
    kw = dict(kwargs)
    for alias in ("max_tokens", "max_completion_tokens"):
        if alias in kw:
            value = kw.pop(alias)
            kw.setdefault("max_new_tokens", value)
    if "typical_p" in kw:
        kw.setdefault("typical", kw.pop("typical_p"))
    if "do_sample" in kw:
        if kw.pop("do_sample") is False:
            kw["temperature"] = 0.0
    if "logprobs" in kw or "top_logprobs" in kw:
        want, top = kw.pop("logprobs", None), kw.pop("top_logprobs", None)
        if isinstance(want, int) and not isinstance(want, bool):
            kw["logprobs"] = want  # the number of alternatives, as our own setting takes it
        elif want or (top and want is None):
            kw["logprobs"] = int(top or 0)
    return kw


def _close(name: str, known: Iterable[str]) -> str:
    match = difflib.get_close_matches(name, list(known), n=1)
    return f"{name!r}" + (f" (did you mean {match[0]!r}?)" if match else "")


def _read_template(value: str | None) -> str | None:
    """``chat_template`` is template text, or the path of a file that holds it."""
    if value is None or "{" in value:
        return value
    path = Path(os.path.expanduser(value))
    if path.is_file():
        from .runtime.files import TEMPLATE_LIMIT, read_text

        return read_text(path, "chat template file", TEMPLATE_LIMIT)
    raise InvalidSettingsError(f"chat_template {value!r} is neither a jinja template nor a file that exists.")


class ExLlamaConfig(BaseModel):
    """Fields shared by ``ExLlamaLLM``, ``ChatExLlama`` and LlamaIndex's ``ExLlamaLLM`` (not a framework class)."""

    model_config = ConfigDict(
        arbitrary_types_allowed=True, populate_by_name=True, protected_namespaces=(), use_attribute_docstrings=True
    )

    model_dir: str | None = None
    """Model directory (config.json, safetensors or EXL3 weights, tokenizer) or a Hugging Face Hub id, loaded here."""
    base_url: str | None = None
    """An exllama-integrations server (``http://127.0.0.1:8000``): use its model instead of loading one."""
    api_key: SecretStr | None = None
    """Bearer key for ``base_url``'s server (or set ``EXLLAMA_API_KEY``)."""
    runtime: Any = Field(default=None, exclude=True)
    """Any loaded Runtime (ExLlamaRuntime, RemoteRuntime, ...) to use as it is."""
    backend: str = "auto"
    """``auto`` (exllamav3 on CUDA, then ExLlama v1 for GPTQ, else the CPU reference), ``exllamav3``, ``exllama``,
    ``exllamav2``, ``transformers``."""
    shared_runtime: bool = True
    """Reuse the runtime already loaded for this directory and options (True), or load a private one."""
    max_seq_len: int | None = None
    """Context (cache) length to allocate; None: the model's, capped by the backend's default."""
    dtype: str | None = None
    """Weights dtype for backends that take one (CPU reference: float32 by default)."""
    device: str | None = None
    """Device for backends that take one (``cpu``, ``cuda:0``)."""
    backend_options: dict[str, Any] = Field(default_factory=dict)
    """Backend load options (exllamav3: ``cache_size``, ``cache_bits``, ``gpu_split``; exllama: ``lora_dir``);
    unknown ones are refused by name."""

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
    """Locally typical sampling mass; 1.0 disables (not on exllamav3)."""
    repetition_penalty: float | None = None
    """Repetition penalty; 1.0 disables."""
    no_repeat_ngram_size: int | None = None
    """Never repeat an n-gram of this many tokens (breaks greedy loops of small models; not on exllamav3)."""
    seed: int | None = None
    """Sampling seed: the same seed and prompt reproduce the output."""
    stop: list[str] | None = None
    """Stop strings, merged with the ``stop`` of each call; never part of the output."""
    logprobs: bool | None = None
    """Return each token's log-probability (in the metadata, OpenAI's shape)."""
    top_logprobs: int | None = None
    """With ``logprobs``: this many most likely alternatives per token."""
    chat_template: str | None = None
    """A chat template (jinja text, or a file holding it) to use instead of the model's own, in the same sandbox."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra variables for the chat template (e.g. ``{"enable_thinking": False}``)."""
    split_special_tokens: bool = False
    """Encode message text literally, so special-token strings a user types (``<|im_end|>``) stay text.
    Off by default, as in transformers: such strings become control tokens."""

    _runtime: Any = PrivateAttr(default=None)

    def __init__(self, **data: Any) -> None:
        """Validate the arguments, then the generation settings, then load (or borrow) the runtime.

        Typed errors (InvalidSettingsError, ModelNotFoundError, ...) reach the caller as themselves,
        never wrapped in pydantic's ValidationError.
        """
        data = self._normalize_init(data)
        try:
            super().__init__(**data)
        except ValidationError as e:
            lines = [
                f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']} (got {err.get('input')!r})" for err in e.errors()
            ]
            raise InvalidSettingsError(f"invalid arguments for {type(self).__name__}: " + "; ".join(lines)) from None
        self.chat_template = _read_template(self.chat_template)
        if self.chat_template is not None:
            from .runtime.template import ChatTemplate

            ChatTemplate(self.chat_template)  # a broken override fails here, not at the first chat
        defaults = self._default_overrides()  # bad values fail before anything loads
        self._runtime = self._open_runtime()
        self._runtime.resolve_settings(None, **defaults)  # settings the backend cannot honour

    @classmethod
    def _normalize_init(cls, data: dict[str, Any]) -> dict[str, Any]:
        data = dict(data)
        if "do_sample" in data and data.pop("do_sample") is False and data.get("temperature") is None:
            data["temperature"] = 0.0
        if "typical_p" in data:
            data.setdefault("typical", data.pop("typical_p"))
        if isinstance(data.get("stop"), str):
            data["stop"] = [data["stop"]]
        lp = data.get("logprobs")
        if isinstance(lp, int) and not isinstance(lp, bool):
            data["logprobs"], data["top_logprobs"] = True, lp
        known = set()
        for name, f in cls.model_fields.items():
            known.add(name)
            if f.alias:
                known.add(f.alias)
        unknown = [k for k in data if k not in known]
        if unknown:
            raise InvalidSettingsError(
                f"unknown argument(s) for {cls.__name__}: {', '.join(_close(k, known) for k in sorted(unknown))}."
            )
        return data

    def _open_runtime(self) -> Runtime:
        given = [n for n in ("model_dir", "base_url", "runtime") if getattr(self, n)]
        if len(given) != 1:
            raise InvalidSettingsError(
                "pass exactly one of model_dir='path/to/model', base_url='http://127.0.0.1:8000' or runtime=..."
                + (f" (got {', '.join(given)})" if given else "")
            )
        if self.runtime is not None:
            if not isinstance(self.runtime, Runtime):
                raise InvalidSettingsError(f"runtime= must be a Runtime, got {type(self.runtime).__name__}.")
            return self.runtime
        if self.base_url:
            from .serve.remote import RemoteRuntime

            key = self.api_key.get_secret_value() if self.api_key is not None else None
            return RemoteRuntime.shared(self.base_url, api_key=key)
        from .runtime.local import ExLlamaRuntime

        factory = ExLlamaRuntime.shared if self.shared_runtime else ExLlamaRuntime
        assert self.model_dir is not None
        return factory(
            self.model_dir,
            self.backend,
            max_seq_len=self.max_seq_len,
            dtype=self.dtype,
            device=self.device,
            **self.backend_options,
        )

    @property
    def exllama_runtime(self) -> Runtime:
        """The runtime this wrapper uses."""
        return self._runtime

    @property
    def model_name(self) -> str:
        """The model's name (its directory's)."""
        return self._runtime.model_info().name

    def _default_overrides(self) -> dict[str, Any]:
        """The instance's settings fields as overrides (validated)."""
        fields: dict[str, Any] = {k: getattr(self, k) for k in SETTING_FIELDS}
        if self.logprobs:
            fields["logprobs"] = int(self.top_logprobs or 0)
        fields["stop"] = self.stop or None
        clean = {k: v for k, v in fields.items() if v is not None}
        GenerationSettings().merged(**clean)
        return clean

    def _call_settings(
        self, stop: str | Iterable[str] | None, kwargs: Mapping[str, Any], ignored: Iterable[str] = ()
    ) -> GenerationSettings:
        """Settings for one call: runtime defaults < instance fields < call kwargs; stop strings unioned.

        Raises:
            InvalidSettingsError: an unknown name (the closest match named) or a bad value.
        """
        kw = normalize_call_kwargs({k: v for k, v in kwargs.items() if k not in set(ignored)})
        call_stop = as_stops(kw.pop("stop", None))
        check_setting_names(list(kw), "generation argument")
        overrides = {**self._default_overrides(), **{k: v for k, v in kw.items() if v is not None}}
        stops = [*(self.stop or []), *as_stops(stop), *call_stop]
        overrides["stop"] = list(dict.fromkeys(stops)) or None
        return self._runtime.resolve_settings(None, **{k: v for k, v in overrides.items() if v is not None})

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` by the model's own tokenizer."""
        return self._runtime.encode(text)

    def get_num_tokens(self, text: str) -> int:
        """Number of tokens in ``text`` by the model's own tokenizer."""
        return self._runtime.count_tokens(text)
