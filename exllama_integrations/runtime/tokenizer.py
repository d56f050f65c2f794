"""The model's own tokenizer: tokenizer.json (tokenizers) or tokenizer.model (sentencepiece).

Special tokens and end-of-turn ids come from the model's files, and chat templates are rendered in
jinja2's immutable sandbox, so a model directory from the internet cannot run code through them.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from typing import Any

from ..errors import InvalidModelError
from .model_dir import ModelDirectory

logger = logging.getLogger(__name__)


def _token_text(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return str(v["content"])
    return None


class ChatTemplateError(InvalidModelError):
    """The model's chat template failed to render (or tried to do something the sandbox forbids)."""


class NativeTokenizer:
    """Encode, decode, count and render chat prompts with the model's native tokenizer.

    Example:
        >>> tok = NativeTokenizer.from_model_dir(model_dir)  # doctest: +SKIP
        >>> tok.decode(tok.encode("Hello world"))  # doctest: +SKIP
        'Hello world'
    """

    def __init__(self, model: ModelDirectory) -> None:
        self._model = model
        self._cfg = model.tokenizer_config
        self._special_ids: set[int] = set()
        self._special_by_text: dict[str, int] = {}
        self._hf: Any = None
        self._sp: Any = None
        if model.tokenizer_json is not None:
            from tokenizers import Tokenizer

            try:
                self._hf = Tokenizer.from_file(str(model.tokenizer_json))
            except Exception as e:  # tokenizers raises plain Exception subclasses
                raise InvalidModelError(f"tokenizer.json could not be loaded: {e}") from None
            for tid, added in self._hf.get_added_tokens_decoder().items():
                if added.special:
                    self._special_ids.add(tid)
                    self._special_by_text[added.content] = tid
            self.vocab_size = self._hf.get_vocab_size(with_added_tokens=True)
        else:
            import sentencepiece as spm

            self._sp = spm.SentencePieceProcessor()
            try:
                self._sp.Load(str(model.tokenizer_model))
            except (OSError, RuntimeError) as e:
                raise InvalidModelError(f"tokenizer.model could not be loaded: {e}") from None
            self.vocab_size = self._sp.GetPieceSize()
            for tid in range(self.vocab_size):
                if self._sp.IsControl(tid) or self._sp.IsUnknown(tid):
                    self._special_ids.add(tid)
                    self._special_by_text[self._sp.IdToPiece(tid)] = tid
            for tid_s, entry in (self._cfg.get("added_tokens_decoder") or {}).items():
                text = _token_text(entry)
                if text is not None and (not isinstance(entry, dict) or entry.get("special", True)):
                    self._special_by_text[text] = int(tid_s)
                    self._special_ids.add(int(tid_s))
        self._special_re = (
            re.compile("(" + "|".join(re.escape(t) for t in sorted(self._special_by_text, key=len, reverse=True)) + ")")
            if self._special_by_text
            else None
        )

    @classmethod
    def from_model_dir(cls, model: ModelDirectory | str) -> NativeTokenizer:
        """Load the tokenizer of a model directory (path or inspected :class:`ModelDirectory`)."""
        return cls(model if isinstance(model, ModelDirectory) else ModelDirectory.inspect(model))

    # ------------------------------------------------------------------ ids

    def token_to_id(self, text: str) -> int | None:
        """The id of a token given by its text (special tokens included), or None."""
        if text in self._special_by_text:
            return self._special_by_text[text]
        if self._hf is not None:
            return self._hf.token_to_id(text)
        assert self._sp is not None
        tid = self._sp.PieceToId(text)
        return None if tid == self._sp.unk_id() and text != self._sp.IdToPiece(tid) else tid

    def _cfg_token_id(self, key: str) -> int | None:
        text = _token_text(self._cfg.get(key))
        return self.token_to_id(text) if text else None

    @cached_property
    def bos_token_id(self) -> int | None:
        """Beginning-of-sequence id, or None."""
        for source in (self._model.generation_config, self._model.config):
            v = source.get("bos_token_id")
            if isinstance(v, int):
                return v
        tid = self._cfg_token_id("bos_token")
        if tid is None and self._sp is not None and self._sp.bos_id() >= 0:
            return int(self._sp.bos_id())
        return tid

    @cached_property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends a turn: generation_config, config and tokenizer_config eos, deduplicated."""
        ids: list[int] = []
        for source in (self._model.generation_config, self._model.config):
            v = source.get("eos_token_id")
            if isinstance(v, int):
                ids.append(v)
            elif isinstance(v, list):
                ids.extend(int(x) for x in v if isinstance(x, int))
        tid = self._cfg_token_id("eos_token")
        if tid is not None:
            ids.append(tid)
        if not ids and self._sp is not None and self._sp.eos_id() >= 0:
            ids.append(int(self._sp.eos_id()))
        return list(dict.fromkeys(ids))

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of special tokens (never shown in decoded text)."""
        return frozenset(self._special_ids)

    @cached_property
    def add_bos(self) -> bool:
        """Whether plain-text prompts start with BOS (tokenizer_config's add_bos_token)."""
        v = self._cfg.get("add_bos_token")
        if isinstance(v, bool):
            return v
        return self._sp is not None  # sentencepiece Llama tokenizers add BOS by default

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Special-token strings in the text become their ids.

        ``add_special_tokens`` adds what the tokenizer adds to a plain prompt (BOS for Llama);
        use False for text rendered by a chat template, which carries its own.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        if self._hf is not None:
            ids = list(self._hf.encode(text, add_special_tokens=add_special_tokens).ids)
        else:
            ids = self._sp_encode(text)
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids.insert(0, self.bos_token_id)
        return ids

    def _sp_encode(self, text: str) -> list[int]:
        assert self._sp is not None
        parts = self._special_re.split(text) if self._special_re else [text]
        ids: list[int] = []
        for i, part in enumerate(parts):
            if not part:
                continue
            if i % 2 == 1:
                ids.append(self._special_by_text[part])
            else:
                ids.extend(self._sp.EncodeAsIds(part))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens dropped unless ``skip_special_tokens`` is False."""
        ids = [int(i) for i in ids]
        if self._hf is not None:
            return str(self._hf.decode(ids, skip_special_tokens=skip_special_tokens))
        assert self._sp is not None
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
            return str(self._sp.DecodeIds(ids))
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in self._special_ids:
                out.append(self._sp.DecodeIds(run))
                out.append(self._sp.IdToPiece(i))
                run = []
            else:
                run.append(i)
        out.append(self._sp.DecodeIds(run))
        return "".join(out)

    def count(self, text: str, add_special_tokens: bool = False) -> int:
        """Number of tokens in ``text`` (without BOS unless asked)."""
        return len(self.encode(text, add_special_tokens=add_special_tokens))

    def tokenizer_json_str(self) -> str | None:
        """tokenizer.json as a string (for llguidance), or None for sentencepiece models."""
        return self._hf.to_str() if self._hf is not None else None

    def token_bytes(self) -> list[bytes]:
        """The raw bytes of every token id (for constrained decoding on sentencepiece models)."""
        assert self._sp is not None, "token_bytes is only needed for sentencepiece tokenizers"
        out = []
        for tid in range(self.vocab_size):
            piece = self._sp.IdToPiece(tid)
            if self._sp.IsByte(tid):
                out.append(bytes([int(piece[3:5], 16)]))
            elif tid in self._special_ids:
                out.append(b"")
            else:
                out.append(piece.replace("\u2581", " ").encode("utf-8"))
        return out

    # ------------------------------------------------------------------ chat template

    @cached_property
    def chat_template(self) -> str | None:
        """The model's chat template (tokenizer_config.json, chat_template.jinja or .json), or None."""
        t = self._cfg.get("chat_template")
        if isinstance(t, list):  # named templates: take "default"
            named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
            t = named.get("default") or next(iter(named.values()), None)
        if isinstance(t, str) and t.strip():
            return t
        root = self._model.path
        if (root / "chat_template.jinja").is_file():
            return (root / "chat_template.jinja").read_text(encoding="utf-8")
        if (root / "chat_template.json").is_file():
            data = json.loads((root / "chat_template.json").read_text(encoding="utf-8"))
            if isinstance(data, dict) and isinstance(data.get("chat_template"), str):
                return str(data["chat_template"])
        return None

    @cached_property
    def _compiled_template(self) -> Any:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ChatTemplateError(f"the chat template refused the messages: {message}")

        def tojson(
            x: Any,
            ensure_ascii: bool = False,
            indent: int | None = None,
            separators: Any = None,
            sort_keys: bool = False,
        ) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        def strftime_now(fmt: str) -> str:
            return datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        try:
            return env.from_string(self.chat_template or _FALLBACK_TEMPLATE)
        except TemplateError as e:
            raise ChatTemplateError(f"the model's chat template does not compile: {e}") from None

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render messages (``{"role", "content", ...}`` dicts) into the prompt text the model expects.

        Models without a template use a documented ChatML fallback (and a warning once).

        Raises:
            ChatTemplateError: the template failed, or tried to reach what the sandbox forbids.
        """
        from jinja2.exceptions import SecurityError, TemplateError

        if self.chat_template is None and not getattr(self, "_warned_fallback", False):
            logger.warning("model %s has no chat template; using the ChatML fallback", self._model.name)
            self._warned_fallback = True
        ctx = {
            "bos_token": _token_text(self._cfg.get("bos_token")) or "",
            "eos_token": _token_text(self._cfg.get("eos_token")) or "",
            **kwargs,
        }
        try:
            return str(
                self._compiled_template.render(
                    messages=[dict(m) for m in messages],
                    tools=list(tools) if tools else None,
                    add_generation_prompt=add_generation_prompt,
                    **ctx,
                )
            )
        except ChatTemplateError:
            raise
        except SecurityError as e:
            raise ChatTemplateError(f"the chat template tried an unsafe operation and was stopped: {e}") from None
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template failed to render: {e}") from None
        except Exception as e:  # noqa: BLE001 - a model's template is untrusted input; never let it escape raw
            raise ChatTemplateError(f"the chat template failed to render: {type(e).__name__}: {e}") from None


# ChatML, used when a model ships no template (documented in the README).
_FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
