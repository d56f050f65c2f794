"""Generation settings, validated once and shared by every backend."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import InvalidSettingsError

SAMPLING_FIELDS = (
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "typical",
    "repetition_penalty",
    "no_repeat_ngram_size",
    "seed",
)
"""The settings that framework wrappers expose as their own fields."""


class GenerationSettings(BaseModel):
    r"""How to sample one completion.

    Every backend reads the same settings, so a prompt gives the same greedy output on the CPU
    reference backend and on ExLlama. ``temperature=0`` (or ``top_k=1``) means greedy decoding.

    Example:
        >>> from exllama_integrations import GenerationSettings
        >>> s = GenerationSettings(max_new_tokens=32, temperature=0)
        >>> s.greedy
        True
        >>> s.merged(temperature=0.7, stop=["\\n"]).stop
        ['\\n']
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_new_tokens: int | None = Field(default=256, ge=1)
    """Most tokens to generate; ``None`` fills what is left of the context."""
    temperature: float = Field(default=0.8, ge=0.0, le=100.0)
    """Softmax temperature; 0 means greedy."""
    top_k: int = Field(default=0, ge=0)
    """Keep only the k most likely tokens; 0 disables."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass; 1.0 disables."""
    min_p: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Drop tokens below min_p times the top probability; 0 disables."""
    typical: float = Field(default=1.0, gt=0.0, le=1.0)
    """Locally typical sampling mass; 1.0 disables."""
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    """Penalty on tokens already in the prompt or output (CTRL-style); 1.0 disables."""
    no_repeat_ngram_size: int = Field(default=0, ge=0, le=64)
    """Never repeat an n-gram of this many tokens (breaks greedy loops in small models); 0 disables."""
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    """Seed for sampling; the same seed, prompt and settings give the same output on one backend."""
    stop: list[str] = Field(default_factory=list)
    """Stop strings: generation ends before the first one, which is never part of the output."""
    stop_token_ids: list[int] = Field(default_factory=list)
    """Extra token ids that end generation (the model's end-of-turn ids always do)."""
    ignore_eos: bool = False
    """Keep generating past the model's end-of-sequence tokens (benchmarks)."""
    logprobs: int | None = Field(default=None, ge=0, le=20)
    """Report the chosen token's log-probability and this many top alternatives per token."""
    truncate_prompt: bool = False
    """If the prompt does not fit, keep its end instead of raising ContextLengthError."""

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        if v is None:
            return []
        if isinstance(v, str):
            return [v]
        if not isinstance(v, (list, tuple)):
            raise ValueError(f"stop must be a list of strings, got {type(v).__name__}")
        for item in v:
            if not isinstance(item, str):
                raise ValueError(
                    f"stop must hold strings, got {item!r} ({type(item).__name__}); use stop_token_ids for token ids"
                )
            if item == "":
                raise ValueError("stop strings must not be empty")
        return list(dict.fromkeys(v))

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _stop_ids(cls, v: Any) -> Any:
        if v is None:
            return []
        if isinstance(v, int):
            return [v]
        return v

    @model_validator(mode="after")
    def _check(self) -> GenerationSettings:
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative token ids")
        return self

    @property
    def greedy(self) -> bool:
        """Whether decoding is greedy (argmax at every step)."""
        return self.temperature == 0.0 or self.top_k == 1

    def merged(self, **overrides: Any) -> GenerationSettings:
        """Return new settings with ``overrides`` (``None`` values ignored) applied; ``self`` is unchanged.

        Stop strings and stop ids are unioned, as LangChain does with a call's ``stop``.

        Raises:
            InvalidSettingsError: a value is out of range or of the wrong type.
        """
        clean = {k: v for k, v in overrides.items() if v is not None}
        data = self.model_dump()
        for key in ("stop", "stop_token_ids"):
            if key in clean:
                extra = clean.pop(key)
                extra = [extra] if isinstance(extra, (str, int)) else extra
                if not isinstance(extra, (list, tuple)):
                    raise InvalidSettingsError(f"{key} must be a list, got {type(extra).__name__}")
                data[key] = list(data[key]) + list(extra)
        data.update(clean)
        return build_settings(data)


def build_settings(values: Mapping[str, Any]) -> GenerationSettings:
    """Validate ``values`` into settings, turning pydantic's error into an InvalidSettingsError.

    Raises:
        InvalidSettingsError: with one line per bad field, naming the field and the rule.
    """
    try:
        return GenerationSettings(**values)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "settings"
            lines.append(f"{loc}: {err['msg']} (got {err.get('input')!r})")
        raise InvalidSettingsError("invalid generation settings: " + "; ".join(lines)) from None


def call_overrides(
    fields: Mapping[str, Any], call_kwargs: Mapping[str, Any], stop: Sequence[str] = ()
) -> dict[str, Any]:
    """The overrides a framework wrapper asks of the runtime for one call (for ``resolve_settings``).

    The wrapper's setting ``fields``, then the call's keyword arguments that are settings
    (``max_tokens`` read as ``max_new_tokens``; other keys are the caller's to check); stop strings
    are ``stop`` followed by the call's own. ``None`` values are dropped.
    """
    kw = dict(call_kwargs)
    if "max_tokens" in kw:
        kw["max_new_tokens"] = kw.pop("max_tokens")
    params = {**fields, **{k: v for k, v in kw.items() if k in GenerationSettings.model_fields}}
    params["stop"] = [*stop, *(params.get("stop") or [])] or None
    return {k: v for k, v in params.items() if v is not None}
