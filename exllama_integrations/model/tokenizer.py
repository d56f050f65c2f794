"""The model's own tokenizer: tokenizer.json (tokenizers) or tokenizer.model (sentencepiece).

Special tokens and end-of-turn ids come from the model's files, and chat templates are rendered in
a bounded sandbox (:mod:`.template`), so a model directory from the internet can neither run code
nor hang a caller through them. The files come from a :class:`ModelDirectory`, or from any
:class:`TokenizerSource` (the HTTP client builds one from a server's tokenizer files, no weights).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

from ..errors import ChatTemplateError, InvalidModelError
from .directory import ModelDirectory
from .template import ChatTemplate, render_messages

logger = logging.getLogger(__name__)
_LONG_TEXT = 20_000


class TokenizerSource(Protocol):
    """What a tokenizer is built from (a :class:`ModelDirectory` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def tokenizer_json(self) -> Path | None: ...

    @property
    def tokenizer_model(self) -> Path | None: ...

    @property
    def tokenizer_config(self) -> dict[str, Any]: ...

    @property
    def generation_config(self) -> dict[str, Any]: ...

    @property
    def config(self) -> dict[str, Any]: ...

    @property
    def chat_template(self) -> str | None: ...


def _token_text(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return str(v["content"])
    return None


class NativeTokenizer:
    """Encode, decode, count and render chat prompts with the model's native tokenizer.

    Example:
        >>> tok = NativeTokenizer.from_model_dir(model_dir)  # doctest: +SKIP
        >>> tok.decode(tok.encode("Hello world"))  # doctest: +SKIP
        'Hello world'
    """

    def __init__(self, model: TokenizerSource) -> None:
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
            # a tokenizer.json may carry padding or truncation (BERT exports pad every text to 128): ids are exact here
            self._hf.no_padding()
            self._hf.no_truncation()
            self._literal = Tokenizer.from_str(self._hf.to_str())
            self._literal.encode_special_tokens = True
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
        self._templates: dict[str, ChatTemplate] = {}
        self._template_error: ChatTemplateError | None = None
        if model.chat_template is not None:
            try:
                self._template(model.chat_template)
            except ChatTemplateError as e:  # completions still work; chat calls report it
                logger.warning("the chat template of %s does not compile: %s", model.name, e)
                self._template_error = e

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

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``. Special-token strings in the text become their ids unless ``parse_special=False``.

        ``add_special_tokens`` adds what the tokenizer adds to a plain prompt (BOS for Llama);
        use False for text rendered by a chat template, which carries its own.

        Raises:
            InvalidSettingsError: ``text`` is not a str, or holds lone surrogates (not encodable as UTF-8).
        """
        from ..errors import InvalidSettingsError

        if not isinstance(text, str):
            raise InvalidSettingsError(f"text must be str, got {type(text).__name__}.")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidSettingsError(
                "the text holds characters that are not valid UTF-8 (lone surrogates, e.g. from bytes decoded "
                "with 'surrogateescape'); decode the input with errors='replace' first."
            ) from None
        if self._hf is not None:
            hf = self._hf if parse_special else self._literal
            if len(text) > _LONG_TEXT:  # encode_batch releases the GIL: other threads (an event loop) keep running
                # the fast form computes no offsets: the same ids at a third of the memory (6 MB of text, 1M ids:
                # +213 MB at its peak instead of +718 MB) and in half the time; tokenizers 0.21 and later have it
                batch = getattr(hf, "encode_batch_fast", hf.encode_batch)
                ids = list(batch([text], add_special_tokens=add_special_tokens)[0].ids)
            else:
                ids = list(hf.encode(text, add_special_tokens=add_special_tokens).ids)
        else:
            ids = self._sp_encode(text) if parse_special else list(self._sp.EncodeAsIds(text))
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

    @property
    def chat_template(self) -> str | None:
        """The model's chat template, or None (then a ChatML fallback is used, with a warning)."""
        return self._model.chat_template

    def _template(self, source: str) -> ChatTemplate:
        t = self._templates.get(source)
        if t is None:
            t = ChatTemplate(source)
            if len(self._templates) < 16:
                self._templates[source] = t
        return t

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render messages (``{"role", "content", ...}`` dicts) into the prompt text the model expects.

        ``chat_template`` replaces the model's own (rendered in the same sandbox). Models without a
        template use a documented ChatML fallback (and a warning once).

        Raises:
            ChatTemplateError: the template failed, tried what the sandbox forbids, or ran out of budget.
        """
        source = chat_template or self.chat_template
        if chat_template is None and self._template_error is not None:
            raise self._template_error
        if source is None and not getattr(self, "_warned_fallback", False):
            logger.warning("model %s has no chat template; using the ChatML fallback", self._model.name)
            self._warned_fallback = True
        ctx = {
            "bos_token": _token_text(self._cfg.get("bos_token")) or "",
            "eos_token": _token_text(self._cfg.get("eos_token")) or "",
            **kwargs,
        }
        template = self._template(source or _FALLBACK_TEMPLATE)
        return render_messages(
            template, messages, tools=list(tools) if tools else None, add_generation_prompt=add_generation_prompt, **ctx
        )


# ChatML, used when a model ships no template (documented in the README).
_FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
