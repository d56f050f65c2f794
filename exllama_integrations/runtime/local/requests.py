"""How a local runtime turns a request into its backend's: checked, rendered, tokenized, fitted, constrained, steered.

:class:`RequestMaker` is the one job between :class:`~..contract.api.GenerationRequest` and the backend's
:class:`~...backends.BackendRequest`: the request checked against the model's facts, its prompt rendered and tokenized
(each image as the tokens it is read as, in its place), fitted to the context, its grammar compiled, its reasoning
budget steered, its stop ids; and the :class:`~.run.Run` that turns the backend's steps back into chunks. Every typed
error is raised here, before anything runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from ...backends import BackendRequest
from ...contract.api import GenerationRequest, ModelInfo
from ...errors import InvalidSettingsError, MediaError
from ...model.directory import ModelDirectory
from ...model.grammar_worker import GrammarCompiler
from ...model.media import MediaLimits, image_key, open_images
from ...model.tokenizer import NativeTokenizer
from ..base import check_request
from .prompt import fit_to_context, prompt_ids
from .reasoning import ReasoningControl
from .run import Run

if TYPE_CHECKING:
    from ...backends.base import Backend


class RequestMaker:
    """A model's requests made for its backend (see the module docstring); its grammar compiler closes with it."""

    def __init__(
        self,
        model: ModelDirectory,
        tokenizer: NativeTokenizer,
        backend_name: str,
        render: Callable[[GenerationRequest], tuple[Any, bool]],
    ) -> None:
        """``render``: a request's prompt as the model reads it, and whether special tokens are added to it."""
        self.model, self.tokenizer, self.backend_name, self._render = model, tokenizer, backend_name, render
        self._grammars = GrammarCompiler(tokenizer)
        self._piece = lru_cache(maxsize=1 << 16)(self._token_text)

    def _token_text(self, tid: int) -> str:
        return self.tokenizer.decode([tid], skip_special_tokens=False)

    def shown(self, request: GenerationRequest) -> dict[int, str]:
        """The special tokens a request shows as text (a family's tool-call markup), by id."""
        out = {}
        for text in request.show_tokens:
            tid = self.tokenizer.token_to_id(text)
            if tid is not None and tid in self.tokenizer.special_ids:
                out[tid] = text
        return out

    def prepare(
        self, backend: Backend, info: ModelInfo, request: GenerationRequest, put: Any, media: MediaLimits
    ) -> tuple[Run, BackendRequest]:
        """Check and tokenize one request (raising typed errors before anything runs)."""
        check_request(request, info)
        s = request.settings
        ids, embeddings = self.prompt(backend, request, media)
        s_fit = s.model_copy(update={"truncate_prompt": False}) if request.media else s  # an image is never cut
        ids, max_new = fit_to_context(ids, s_fit, backend.context_length)
        matcher = self._grammars.compile(request.grammar).matcher() if request.grammar is not None else None
        control = None
        if request.reasoning is not None:
            r = request.reasoning
            if s.max_reasoning_tokens is not None and r.budget is None:
                r = dataclasses.replace(r, budget=s.max_reasoning_tokens)
            end_ids = self.tokenizer.encode(r.end, add_special_tokens=False)
            if not end_ids:
                raise InvalidSettingsError(f"the reasoning end delimiter {r.end!r} encodes to no tokens.")
            control = ReasoningControl(r, self._piece, end_ids)
        stop_ids = frozenset(s.stop_token_ids) | (
            frozenset() if s.ignore_eos else frozenset(self.tokenizer.eos_token_ids)
        )
        run = Run(self.tokenizer, s, ids, stop_ids, matcher, self.backend_name, control, self.shown(request))
        backend_request = BackendRequest(
            ids,
            s,
            max_new,
            stop_ids,
            run.emit_to(put, request.incremental),
            constraint=matcher,
            steering=control,
            embeddings=embeddings,
            grammar=request.grammar,
        )
        return run, backend_request

    def prompt(self, backend: Backend, request: GenerationRequest, media: MediaLimits) -> tuple[list[int], Any]:
        """The ids the model reads (each image as its tokens, in its place) and the backend's embeddings.

        Raises:
            MediaError: images the model does not take, or cannot read (beyond ``media``'s bounds).
        """
        prompt, add_special = self._render(request)
        if not request.media:
            return prompt_ids(self.tokenizer, prompt, add_special), None
        if backend.vision is not None:
            raise MediaError(f"{self.model.name!r} takes no images: {backend.vision}; send text only.")
        if not isinstance(prompt, str):
            raise MediaError("a request with images needs its prompt as text or messages (the images' places).")
        images = open_images(request.media, media)
        return backend.encode_media(prompt, images, add_special, [image_key(m) for m in request.media])

    def close(self) -> None:
        """Stop the grammar compiler."""
        self._grammars.close()


__all__ = ["RequestMaker"]
