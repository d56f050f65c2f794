"""The one configuration LangChain's and LlamaIndex's classes share: fields, the runtime they use, call settings.

Rules decided here, once, for every class:

* Where the model is (checked in :mod:`._model_source`): exactly one of ``model_dir=`` (load it in this process,
  shared; ``model=`` is accepted as its name, as ChatOllama and vLLM spell it), ``base_url=`` (a server's model,
  through :class:`~exllama_integrations.runtime.remote.RemoteRuntime`; with ``model=``, that one of a server of
  several) or ``runtime=`` (any object with the core :class:`~exllama_integrations.contract.api.Runtime` protocol).
* Settings: the classes' setting fields are :class:`~exllama_integrations.contract.settings.GenerationSettings`'
  own (declared there once, with their docs), optional here; names are those settings accept (``max_tokens``,
  ``num_predict``, ``do_sample=False``, ``logprobs=True`` + ``top_logprobs=k`` ...), also inside ``model_kwargs``
  (LangChain's convention). A call's settings are the runtime's defaults, then the fields, then the call's keyword
  arguments, resolved once into the request; one setting given twice (two names, or an argument and a
  ``model_kwargs`` key) is refused at every door.
* Any other unknown name, in the constructor or per call, is an
  :class:`~exllama_integrations.errors.InvalidSettingsError` naming the closest match (or what another tool's
  name means here); settings a backend cannot honour are refused when the class is built.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, ValidationError

from ._model_source import check_one_place, server_runtime
from .chat.formats.table import find_format
from .contract.api import Reasoning, Runtime
from .contract.settings import (
    ACCEPTED_NAMES,
    ALIASES,
    SAMPLING_FIELDS,
    GenerationSettings,
    canonical,
    check_names,
    check_one_name_each,
    resolve_settings,
    unknown_name_hint,
)
from .errors import InvalidSettingsError, ModelNotFoundError
from .model.template_override import read_template_override

SETTING_FIELDS = SAMPLING_FIELDS
"""The generation settings that are also fields of the framework classes."""
_OWN_FIELDS = frozenset({*SETTING_FIELDS, "stop", "logprobs"})
"""Settings (by field name) that a ``model_kwargs`` key moves to a field of the classes."""


def as_stops(stop: str | Iterable[str] | None) -> list[str]:
    """A call's or field's ``stop`` as a list: one string is one stop string, never its characters."""
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    return list(stop)


class SettingFields(BaseModel):
    """GenerationSettings' sampling fields as the classes' own, each optional (None: the runtime's default).

    Declared here for type checkers and editors; a unit test pins them to GenerationSettings (names and types).
    """

    max_new_tokens: int | None = Field(default=None, alias="max_tokens")
    """Most tokens to generate, thinking included (``max_tokens`` and ``num_predict`` are accepted too)."""
    temperature: float | None = None
    """Sampling temperature; 0 is greedy."""
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
    presence_penalty: float | None = None
    """OpenAI's presence penalty (-2 to 2) over the output so far; 0 disables."""
    frequency_penalty: float | None = None
    """OpenAI's frequency penalty (-2 to 2) over the output so far; 0 disables."""
    no_repeat_ngram_size: int | None = None
    """Never repeat an n-gram of this many tokens (breaks greedy loops of small models; not on exllamav3)."""
    seed: int | None = None
    """Sampling seed: the same seed and prompt reproduce the output."""
    max_reasoning_tokens: int | None = None
    """A reasoning model thinks for at most this many tokens, then answers (``thinking_token_budget`` too)."""


class ExLlamaConfig(SettingFields):
    """Fields shared by ``ExLlamaLLM``, ``ChatExLlama`` and LlamaIndex's ``ExLlamaLLM`` (not a framework class)."""

    model_config = ConfigDict(
        arbitrary_types_allowed=True, populate_by_name=True, protected_namespaces=(), use_attribute_docstrings=True
    )

    model_dir: str | None = None
    """Model directory (config.json, safetensors or EXL3 weights, tokenizer) or a Hugging Face Hub id, loaded here."""
    base_url: str | None = None
    """An exllama-integrations server (``http://127.0.0.1:8000``): use its model instead of loading one."""
    server_model: str | None = None
    """With ``base_url=``: which of the server's models (its name in ``/v1/models``; ``model=`` sets it, as for
    ChatOpenAI); None: the server's first."""
    api_key: SecretStr | None = None
    """Bearer key for ``base_url``'s server (or set ``EXLLAMA_API_KEY``)."""
    runtime: Any = Field(default=None, exclude=True)
    """Any loaded Runtime (ExLlamaRuntime, RemoteRuntime, your own) to use as it is."""
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
    """Backend load options (exllamav3: ``cache_size``, ``cache_bits``, ``gpu_split``; exllama: ``lora_dir``;
    CPU reference: ``num_threads``); unknown ones are refused by name."""
    engine: Literal["thread", "process"] = "thread"
    """With ``model_dir=``: where the model's driver runs: a thread of this process, or (``"process"``) an engine
    process of its own, so nothing in this process (your app, callbacks, a web server) shares its Python."""
    engines: int = 1
    """With ``model_dir=``: engine processes, each with its own copy of the model (implies ``engine="process"``)."""
    stop: list[str] | None = None
    """Stop strings, merged with the ``stop`` of each call; never part of the output."""
    logprobs: bool | None = None
    """Return each token's log-probability (in the metadata, OpenAI's shape)."""
    top_logprobs: int | None = None
    """With ``logprobs``: this many most likely alternatives per token."""
    chat_template: str | None = None
    """A chat template (jinja text, or a file holding it) to use instead of the model's own, in the same sandbox."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra variables for the chat template (e.g. ``{"enable_thinking": False}``), merged with each call's."""
    reasoning_tags: tuple[str, str] | None = None
    """A reasoning model's thinking delimiters, e.g. ``("<think>", "</think>")``, where its chat template does
    not show them (they are found in the template otherwise)."""
    tool_format: str | None = None
    """A model family's tool-call format by name (``hermes``, ``llama3_json``, ``mistral``, ``harmony``, ...: see the
    table in docs/tool-calls.md), where the chat template does not show it; found from the template otherwise."""
    split_special_tokens: bool = False
    """Encode message text literally, so special-token strings a user types (``<|im_end|>``) stay text.
    Off by default, as in transformers: such strings become control tokens."""
    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Generation settings by any accepted name (LangChain's convention), e.g. ``{"logit_bias": {...}}``; those
    that are fields of their own (``max_tokens``, ``temperature`` ...) are moved to their fields."""

    _runtime: Any = PrivateAttr(default=None)

    def __init__(self, **data: Any) -> None:
        """Validate the arguments, then the generation settings, then load (or borrow) the runtime.

        Typed errors (InvalidSettingsError, ModelNotFoundError, ...) reach the caller as themselves,
        never wrapped in pydantic's ValidationError.
        """
        named = data.get("model") if not any(data.get(k) for k in ("model_dir", "base_url", "runtime")) else None
        data = self._normalize_init(data)
        try:
            super().__init__(**data)
        except ValidationError as e:
            lines = [
                f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']} (got {err.get('input')!r})" for err in e.errors()
            ]
            raise InvalidSettingsError(f"invalid arguments for {type(self).__name__}: " + "; ".join(lines)) from None
        self.chat_template = read_template_override(self.chat_template)
        if self.chat_template is not None:
            from .model.template import ChatTemplate

            ChatTemplate(self.chat_template)  # a broken override fails here, not at the first chat
        if self.reasoning_tags is not None:
            Reasoning(*self.reasoning_tags)
        if self.tool_format is not None:
            find_format(None, self.tool_format)  # a name that is no format fails here, with the names there are
        defaults = self._field_settings()
        GenerationSettings().merged(**defaults)  # bad values fail before anything loads
        try:
            self._runtime = self._open_runtime()
        except ModelNotFoundError as e:
            if named is None:
                raise
            raise ModelNotFoundError(
                f"{e} If {named!r} is the name of a served model, pass the server's address as well: "
                f"base_url='http://127.0.0.1:8000' (model= names a model directory only without base_url=)."
            ) from None
        resolve_settings(self._defaults(), self._runtime.model_info().unsupported_settings, **defaults)
        self._loaded()

    def _loaded(self) -> None:
        """Called once the runtime is there (a class fills in what it reads from the model)."""

    @classmethod
    def _normalize_init(cls, data: dict[str, Any]) -> dict[str, Any]:
        extra = data.get("model_kwargs")
        if extra is not None:
            if not isinstance(extra, Mapping):
                raise InvalidSettingsError(
                    f"model_kwargs must be a dict of generation settings, got {type(extra).__name__}."
                )
            check_names(list(extra), "model_kwargs key")
            check_one_name_each(
                [*(k for k, v in data.items() if v is not None), *(k for k, v in extra.items() if v is not None)]
            )
        data = canonical({k: v for k, v in data.items() if k != "model_kwargs"})
        for name, value in canonical(extra or {}).items():  # a setting with a field of its own goes there
            if name in _OWN_FIELDS:
                data[name] = value
            else:
                data.setdefault("model_kwargs", {})[name] = value
        if "model" in data:  # ChatOllama's / ChatOpenAI's / vLLM's name for the model
            model = data.pop("model")
            if data.get("base_url"):
                data.setdefault("server_model", model)  # a model of the server
            elif not data.get("runtime"):
                data.setdefault("model_dir", model)
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
                f"unknown argument(s) for {cls.__name__}: "
                + ", ".join(unknown_name_hint(k, known) for k in sorted(unknown))
                + "."
            )
        return data

    def configurable_name(self, name: str) -> str:
        """The field a constructor argument sets (``max_tokens`` -> ``max_new_tokens``), for configurable fields.

        Raises:
            InvalidSettingsError: a name that sets no field, with the name to use, in one line.
        """
        fields = type(self).model_fields
        if name in fields:
            return name
        for field, info in fields.items():
            if info.alias == name:
                return field
        aliased = ALIASES.get(name)
        if aliased is not None and aliased in fields:
            return aliased
        if name == "model" and (self.model_dir or self.base_url):
            return "model_dir" if self.model_dir else "server_model"
        if name in ACCEPTED_NAMES:
            hint = f"make 'model_kwargs' configurable (a dict of settings: {{{name!r}: ...}}) or pass it per call"
        else:
            hint = f"unknown {unknown_name_hint(name, fields)}"
        raise InvalidSettingsError(f"{type(self).__name__} has no field {name!r} to make configurable: {hint}.")

    def _open_runtime(self) -> Runtime:
        check_one_place(self)
        if self.runtime is not None:
            if not isinstance(self.runtime, Runtime):
                missing = [m for m in ("model_info", "encode", "decode", "chat_prompt", "open", "aopen", "close")]
                missing = [m for m in missing if not callable(getattr(self.runtime, m, None))]
                raise InvalidSettingsError(
                    f"runtime= must implement the Runtime protocol; {type(self.runtime).__name__} lacks "
                    f"{', '.join(missing) or 'closed'}."
                )
            return self.runtime
        if self.base_url:
            return server_runtime(self)
        from .runtime.local import ExLlamaRuntime

        factory = ExLlamaRuntime.shared if self.shared_runtime else ExLlamaRuntime
        assert self.model_dir is not None
        return factory(
            self.model_dir,
            self.backend,
            max_seq_len=self.max_seq_len,
            dtype=self.dtype,
            device=self.device,
            engine=self.engine,
            engines=self.engines,
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

    def _defaults(self) -> GenerationSettings:
        from .runtime.base import defaults_of

        return defaults_of(self._runtime) if self._runtime is not None else GenerationSettings()

    def _field_settings(self) -> dict[str, Any]:
        """The instance's setting fields that are set, as settings."""
        fields: dict[str, Any] = {k: getattr(self, k) for k in SETTING_FIELDS}
        if self.logprobs:
            fields["logprobs"] = int(self.top_logprobs or 0)
        fields["stop"] = self.stop or None
        fields.update(self.model_kwargs)  # moved to their fields when built: the rest, none of the above
        return {k: v for k, v in fields.items() if v is not None}

    def _call_settings(
        self, stop: str | Iterable[str] | None, kwargs: Mapping[str, Any], ignored: Iterable[str] = ()
    ) -> GenerationSettings:
        """Settings for one call: runtime defaults < instance fields < call kwargs; stop strings unioned.

        Raises:
            InvalidSettingsError: an unknown name (the closest match named) or a bad value.
        """
        skip = set(ignored)
        kw = canonical({k: v for k, v in kwargs.items() if k not in skip})
        call_stop = as_stops(kw.pop("stop", None))
        check_names(list(kw), "generation argument")
        overrides = {**self._field_settings(), **{k: v for k, v in kw.items() if v is not None}}
        stops = [*(self.stop or []), *as_stops(stop), *call_stop]
        overrides["stop"] = list(dict.fromkeys(stops)) or None
        refused = self._runtime.model_info().unsupported_settings
        return resolve_settings(self._defaults(), refused, **{k: v for k, v in overrides.items() if v is not None})

    def _template_kwargs(self, call: Mapping[str, Any] | None) -> dict[str, Any]:
        """The instance's ``chat_template_kwargs`` with a call's own over them."""
        return {**self.chat_template_kwargs, **(call or {})}

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` by the model's own tokenizer."""
        return self._runtime.encode(text)

    def get_num_tokens(self, text: str) -> int:
        """Number of tokens in ``text`` by the model's own tokenizer."""
        return len(self._runtime.encode(text))
