"""A call's prompt as token ids that fit the context (or a typed error saying why not)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...contract.api import Prompt
from ...errors import ContextLengthError, InvalidSettingsError

if TYPE_CHECKING:
    from ...contract.settings import GenerationSettings
    from ...model.tokenizer import NativeTokenizer


def prompt_ids(tokenizer: NativeTokenizer, prompt: Prompt, add_special_tokens: bool) -> list[int]:
    """The token ids of a prompt (text or ids), checked.

    Raises:
        InvalidSettingsError: an empty, bytes or non-UTF-8 prompt, or ids outside the vocabulary.
    """
    if isinstance(prompt, str):
        if prompt == "":
            raise InvalidSettingsError("the prompt is empty; pass some text to complete.")
        return tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    if isinstance(prompt, (bytes, bytearray)):
        raise InvalidSettingsError("the prompt is bytes; decode it to str first (e.g. data.decode('utf-8')).")
    ids = list(prompt)
    if not ids:
        raise InvalidSettingsError("the prompt has no tokens.")
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < tokenizer.vocab_size for i in ids):
        raise InvalidSettingsError(f"prompt token ids must be ints in [0, {tokenizer.vocab_size}).")
    return ids


def fit_to_context(ids: list[int], s: GenerationSettings, ctx: int) -> tuple[list[int], int]:
    """The prompt (its end kept when ``truncate_prompt``) and how many tokens may follow it in ``ctx``.

    Raises:
        ContextLengthError: it does not fit and ``truncate_prompt`` is off.
    """
    want = s.max_new_tokens
    if want is None:
        if len(ids) >= ctx:
            if not s.truncate_prompt:
                raise ContextLengthError(len(ids), 1, ctx)
            ids = ids[-(ctx - 1) :]
        return ids, ctx - len(ids)
    if want >= ctx:
        raise ContextLengthError(len(ids), want, ctx)
    if len(ids) + want > ctx:
        if not s.truncate_prompt:
            raise ContextLengthError(len(ids), want, ctx)
        ids = ids[-(ctx - want) :]
    return ids, want
