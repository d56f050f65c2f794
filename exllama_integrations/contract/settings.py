"""Generation settings: one validated value, and the one table of the names callers use for its fields.

Every door (LangChain, LlamaIndex, the OpenAI endpoints, the native wire, the CLI) hands its names to
:class:`GenerationSettings` as they came: the aliases below are pydantic validation aliases on the
fields themselves, and the few names that mean a conversion (``do_sample=False``, ``logprobs=True`` +
``top_logprobs=k``) are read by one validator. A name that is neither a field nor an alias is refused
with the closest match, or with what it means here when it is a known name from another tool.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import InvalidSettingsError

SAMPLING_FIELDS = (
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "typical",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "no_repeat_ngram_size",
    "seed",
    "max_reasoning_tokens",
)
"""The settings that framework wrappers expose as their own fields."""

FOREIGN_NAMES = {
    "num_ctx": "the context to allocate is `max_seq_len` (a load option, not a per-call setting)",
    "max_length": "`max_new_tokens` counts generated tokens only (transformers' max_length includes the prompt)",
    "num_beams": "beam search is not offered; sampling settings and `temperature=0` (greedy) are",
    "best_of": "send several requests instead; they are batched together",
    "model": "the model is chosen with `model_dir=`, `base_url=` or `runtime=` when the class is built",
}
"""Names other tools use that mean nothing as a setting here, each with what to use instead."""


def _aliases(*names: str) -> AliasChoices:
    return AliasChoices(*names)


class GenerationSettings(BaseModel):
    r"""How to sample one completion.

    Every backend reads the same settings, so a prompt gives the same greedy output on the CPU
    reference backend and on ExLlama. ``temperature=0`` (or ``top_k=1``) means greedy decoding.
    Other tools' names are accepted where they mean the same (``max_tokens``, ``num_predict``,
    ``typical_p``, ``repeat_penalty``, ``do_sample=False``, ``logprobs=True`` + ``top_logprobs``).

    Example:
        >>> from exllama_integrations import GenerationSettings
        >>> s = GenerationSettings(max_tokens=32, temperature=0)
        >>> s.max_new_tokens, s.greedy
        (32, True)
        >>> s.merged(temperature=0.7, stop=["\\n"]).stop
        ['\\n']
    """

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True, use_attribute_docstrings=True)

    max_new_tokens: int | None = Field(
        default=256,
        ge=1,
        validation_alias=_aliases("max_new_tokens", "max_tokens", "max_completion_tokens", "num_predict"),
    )
    """Most tokens to generate (reasoning included); ``None`` fills what is left of the context."""
    temperature: float = Field(default=0.8, ge=0.0, le=100.0)
    """Softmax temperature; 0 means greedy."""
    top_k: int = Field(default=0, ge=0)
    """Keep only the k most likely tokens; 0 disables."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass; 1.0 disables."""
    min_p: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Drop tokens below min_p times the top probability; 0 disables."""
    typical: float = Field(default=1.0, gt=0.0, le=1.0, validation_alias=_aliases("typical", "typical_p"))
    """Locally typical sampling mass; 1.0 disables."""
    repetition_penalty: float = Field(
        default=1.0, gt=0.0, le=10.0, validation_alias=_aliases("repetition_penalty", "repeat_penalty")
    )
    """Penalty on tokens already in the prompt or output (CTRL-style, divides); 1.0 disables."""
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    """Subtracted from the logit of every token the output already holds, once (OpenAI's and vLLM's meaning: the
    prompt is not counted); 0 disables."""
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    """Subtracted from a token's logit once for every time the output already holds it (the prompt is not
    counted); 0 disables."""
    logit_bias: dict[int, float] = Field(default_factory=dict)
    """Added to these tokens' logits before sampling (OpenAI's: -100 bans a token, 100 all but forces it); at most
    1024 tokens, each bias from -100 to 100."""
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
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    """Score the prompt as well: each prompt token's log-probability given the ones before it, with this many top
    alternatives (``prompt_logprobs`` on the last chunk and the result); what evaluation harnesses read. A backend
    that cannot refuses it."""
    truncate_prompt: bool = False
    """If the prompt does not fit, keep its end instead of raising ContextLengthError."""
    max_reasoning_tokens: int | None = Field(
        default=None,
        ge=1,
        validation_alias=_aliases(
            "max_reasoning_tokens", "thinking_token_budget", "thinking_budget", "max_thinking_tokens"
        ),
    )
    """A reasoning model thinks for at most this many tokens; then the runtime closes the block itself and the
    answer follows (within ``max_new_tokens``). None: no budget. Ignored for models that do not reason."""

    @model_validator(mode="before")
    @classmethod
    def _conversions(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        check_one_name_each(k for k, v in data.items() if v is not None)
        return converted(data)

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

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias(cls, v: Any) -> Any:
        if v is None:
            return {}
        if not isinstance(v, Mapping):
            raise ValueError(f"logit_bias must map token ids to biases, got {type(v).__name__}")
        if len(v) > 1024:
            raise ValueError(f"logit_bias may name at most 1024 tokens, got {len(v)}")
        out: dict[int, float] = {}
        for k, b in v.items():
            try:
                tid = int(k)  # OpenAI sends the ids as JSON object keys: strings
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias keys must be token ids, got {k!r}") from None
            if tid < 0:
                raise ValueError(f"logit_bias keys must be token ids (>= 0), got {tid}")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
                raise ValueError(f"logit_bias values must be numbers from -100 to 100, got {b!r} for token {tid}")
            out[tid] = float(b)
        return out

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
        """New settings with ``overrides`` (any accepted name; ``None`` values ignored) applied; ``self`` is unchanged.

        Stop strings and stop ids are unioned, as LangChain does with a call's ``stop``.

        Raises:
            InvalidSettingsError: an unknown name (the closest match named), or a bad value.
        """
        clean = canonical({k: v for k, v in overrides.items() if v is not None})
        if not clean:
            return self
        data: dict[str, Any] = self.model_dump()
        for key in ("stop", "stop_token_ids"):
            if key in clean:
                extra = clean.pop(key)
                extra = [extra] if isinstance(extra, (str, int)) else extra
                if not isinstance(extra, (list, tuple)):
                    raise InvalidSettingsError(f"{key} must be a list, got {type(extra).__name__}")
                data[key] = list(data[key]) + list(extra)
        data.update(clean)
        return build_settings(data)


def _aliases_table() -> dict[str, str]:
    """Every alias -> the field it sets."""
    out: dict[str, str] = {}
    for name, f in GenerationSettings.model_fields.items():
        alias = f.validation_alias
        if isinstance(alias, AliasChoices):
            out.update({str(a): name for a in alias.choices if a != name})
    return out


ALIASES = _aliases_table()
"""Other tools' names for our fields (``max_tokens`` -> ``max_new_tokens``, ...): the one alias table."""
_SAME = {**{name: name for name in GenerationSettings.model_fields}, **ALIASES}
"""Every name that sets a field as it is (no conversion), with the field: a field given twice is two of these."""
ACCEPTED_NAMES = {
    **{name: name for name in GenerationSettings.model_fields},
    **ALIASES,
    "do_sample": "temperature",
    "top_logprobs": "logprobs",
}
"""Every name a caller may use for a setting, with the field it sets (``do_sample`` and ``top_logprobs`` convert)."""


def converted(values: Mapping[str, Any]) -> dict[str, Any]:
    """The names that mean a conversion, converted.

    ``do_sample=False`` is greedy; ``logprobs=True`` + ``top_logprobs=k`` is ``logprobs=k`` (our own form: the
    number of alternatives).
    """
    d = dict(values)
    if "do_sample" in d:
        if d.pop("do_sample") is False and d.get("temperature") is None:
            d["temperature"] = 0.0
    if "logprobs" in d or "top_logprobs" in d:
        want, top = d.pop("logprobs", None), d.pop("top_logprobs", None)
        if isinstance(want, int) and not isinstance(want, bool):
            d["logprobs"] = want
        elif want or (top and want is None):
            d["logprobs"] = int(top or 0)
        else:
            d["logprobs"] = None
    return d


def check_one_name_each(names: Iterable[str], also: Mapping[str, str] | None = None) -> None:
    """Refuse one setting given twice in one request, under two names or one name twice: the rule of every door.

    Two names: ``max_tokens`` and ``max_new_tokens``; one name twice: an argument and a ``model_kwargs`` key.
    ``also``: a door's own names for fields (a wire field -> the setting it sets), beside the alias table.

    Raises:
        InvalidSettingsError: naming both names and the setting they set.
    """
    seen: dict[str, str] = {}
    for name in names:
        field = (also or {}).get(name) or _SAME.get(name)
        if field is None:
            continue
        if field in seen:
            first = seen[field]
            if first == name:
                said = f"{name!r} is given twice (as an argument and in model_kwargs): pass it once."
            else:
                said = f"{first!r} and {name!r} are two names for one setting ({field}): pass one of them."
            raise InvalidSettingsError(said, param=name, reason="duplicate_setting")
        seen[field] = name


def canonical(values: Mapping[str, Any]) -> dict[str, Any]:
    """Settings by any accepted name, as field names (aliases renamed, ``do_sample`` and ``logprobs`` converted).

    Raises:
        InvalidSettingsError: one setting under two names (:func:`check_one_name_each`); ``None`` is not given.
    """
    check_one_name_each(k for k, v in values.items() if v is not None)
    out: dict[str, Any] = {}
    for name, value in converted(values).items():
        out[ALIASES.get(name, name)] = value
    return out


def field_of(name: str) -> str | None:
    """The field a name (a field or an alias) sets, or None."""
    return ACCEPTED_NAMES.get(name)


def unknown_name_hint(name: str, known: Iterable[str] = ()) -> str:
    """``'name'`` with what to use instead: a known foreign name's meaning here, or the closest match."""
    if name in FOREIGN_NAMES:
        return f"{name!r} ({FOREIGN_NAMES[name]})"
    candidates = [c for c in (*ACCEPTED_NAMES, *known) if c != name]  # never "did you mean" the name itself
    close = difflib.get_close_matches(name, candidates, n=1)
    return f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")


def check_names(names: Iterable[str], what: str = "generation setting", known: Iterable[str] = ()) -> None:
    """Refuse names that are not settings (nor in ``known``), naming the closest match.

    Raises:
        InvalidSettingsError: an unknown name.
    """
    extra = set(known)
    unknown = sorted(n for n in names if n not in ACCEPTED_NAMES and n not in extra)
    if unknown:
        hints = ", ".join(unknown_name_hint(n, extra) for n in unknown)
        raise InvalidSettingsError(f"unknown {what}(s): {hints}; valid ones are {', '.join(SETTING_NAMES)}.")


SETTING_NAMES = tuple(GenerationSettings.model_fields)


def build_settings(values: Mapping[str, Any]) -> GenerationSettings:
    """Validate ``values`` (fields or aliases) into settings, turning pydantic's error into an InvalidSettingsError.

    Raises:
        InvalidSettingsError: with one line per bad field, naming the field and the rule.
    """
    check_one_name_each(k for k, v in values.items() if v is not None)  # typed as itself, not in pydantic's error
    try:
        return GenerationSettings.model_validate(dict(values))
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "settings"
            if err.get("type") == "extra_forbidden":
                lines.append(f"unknown setting {unknown_name_hint(str(err['loc'][-1]))}")
            else:
                lines.append(f"{loc}: {err['msg']} (got {err.get('input')!r})")
        raise InvalidSettingsError("invalid generation settings: " + "; ".join(lines)) from None


def resolve_settings(
    base: GenerationSettings, refused: Mapping[str, str] | None = None, **overrides: Any
) -> GenerationSettings:
    """``base`` with ``overrides`` applied, refusing a setting the backend cannot honour (``refused``: name -> why).

    The one place a call's settings are resolved: the result travels in the request and is not resolved again.

    Raises:
        InvalidSettingsError: an unknown name, a bad value, or a refused setting that is set.
    """
    check_names(list(overrides))
    s = base.merged(**overrides)
    check_supported(s, refused or {})
    return s


def check_supported(settings: GenerationSettings, refused: Mapping[str, str]) -> None:
    """Refuse settings a backend cannot honour when they differ from the default.

    Raises:
        InvalidSettingsError: the reason the backend gave.
    """
    default = _DEFAULT
    for name, why in refused.items():
        if getattr(settings, name, None) != getattr(default, name, None):
            raise InvalidSettingsError(why)


_DEFAULT = GenerationSettings()
