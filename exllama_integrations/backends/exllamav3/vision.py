"""exllamav3's vision component: images to ``MMEmbedding`` (cached by image), placed where the template puts them.

exllamav3 loads a vision-language model's image tower as a component of its own (``Model.from_config(config,
component="vision")``); ``get_image_embeddings`` turns a picture into an ``MMEmbedding`` whose token ids (its
own range, past the vocabulary) stand for the picture in the prompt, and a ``Job`` given the embedding reads
them as it. Where the ids go is the model's own layout: each family's template writes a placeholder, and its
Hugging Face processor expands it (Gemma 3: ``<start_of_image>`` becomes two newlines, the image, two newlines);
:data:`PLACEHOLDERS` holds that layout for the families placed here, so prompts match the model's processor
token for token. Text between the images is encoded by the runtime's own tokenizer.

Embeddings are kept in a small LRU cache keyed by the image's bytes: a follow-up turn about the same picture
does not run the tower again, and since the picture keeps its token ids, exllamav3's prefix cache reuses the
whole earlier prompt, image included.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from ...errors import MediaError

if TYPE_CHECKING:
    from ...model.tokenizer import NativeTokenizer

PLACEHOLDERS: dict[str, tuple[str, str, str]] = {
    "gemma3": ("<start_of_image>", "\n\n", "\n\n"),
    "qwen2_vl": ("<|vision_start|><|image_pad|><|vision_end|>", "", ""),
    "qwen2_5_vl": ("<|vision_start|><|image_pad|><|vision_end|>", "", ""),
    "qwen3_vl": ("<|vision_start|><|image_pad|><|vision_end|>", "", ""),
    "qwen3_vl_moe": ("<|vision_start|><|image_pad|><|vision_end|>", "", ""),
    "mistral3": ("[IMG]", "", ""),
}
"""model_type -> (the placeholder its chat template writes for an image, text before and after the image's
tokens that its processor adds). exllamav3's embedding carries the image's own start and end tokens."""

NO_VISION_COMPONENT = "it has no vision component exllamav3 can load"

CACHED_IMAGES = 64
"""Image embeddings kept (an LRU), so a follow-up turn about the same picture skips the vision tower."""


def vision_support(config: Any, model_type: str) -> str | None:
    """Why exllamav3 cannot take images for this model, or None when it can."""
    if "vision" not in getattr(config, "model_classes", {}):
        return NO_VISION_COMPONENT
    if model_type not in PLACEHOLDERS:
        return f"where {model_type!r}'s chat template places images is not known to this package yet"
    return None


def place(
    text: str, embeddings: list[Any], layout: tuple[str, str, str], tokenizer: NativeTokenizer, add_special: bool
) -> list[int]:
    """``text``'s ids with the n-th placeholder replaced by the n-th embedding's tokens (in ``layout``'s frame).

    The text around the images is encoded by the runtime's tokenizer; an embedding gives its ids for the position
    it lands at (``token_list_at``).
    """
    mark, before, after = layout
    pieces = text.split(mark)
    ids: list[int] = []
    for n, piece in enumerate(pieces):
        if n:
            piece = after + piece
        if n < len(embeddings):
            piece += before
        if piece or n == 0:
            ids += tokenizer.encode(piece, add_special_tokens=add_special and n == 0)
        if n < len(embeddings):
            ids += embeddings[n].token_list_at(len(ids))
    return ids


class Vision:
    """A loaded vision component and its embedding cache."""

    def __init__(self, config: Any, model_type: str, load_kw: dict[str, Any]) -> None:
        from .upstream import Model

        self.model = Model.from_config(config, component="vision")
        self.model.load(**load_kw)
        self.layout = PLACEHOLDERS[model_type]
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def embedding(self, key: str, image: Any, xtok: Any) -> Any:
        """The ``MMEmbedding`` of one image (from the cache when this picture was seen)."""
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return found
        import torch

        with torch.inference_mode():
            emb = self.model.get_image_embeddings(tokenizer=xtok, image=image)
        with self._lock:
            self.misses += 1
            self._cache[key] = emb
            while len(self._cache) > CACHED_IMAGES:
                self._cache.popitem(last=False)
        return emb

    def encode(
        self, text: str, images: list[Any], keys: list[str], add_special: bool, tokenizer: NativeTokenizer, xtok: Any
    ) -> tuple[list[int], list[Any]]:
        """Prompt ids with each placeholder replaced by its image's tokens, and the embeddings, in order."""
        count = text.count(self.layout[0])
        if count != len(images):
            raise MediaError(
                f"the prompt places {count} image(s) ({self.layout[0]!r}) but the request has "
                f"{len(images)}; send images inside user messages, so the chat template places them."
            )
        embeddings = [self.embedding(k, im, xtok) for k, im in zip(keys, images)]
        return place(text, embeddings, self.layout, tokenizer, add_special), embeddings

    def close(self) -> None:
        with self._lock:
            self._cache.clear()
        self.model.unload()


__all__ = ["CACHED_IMAGES", "NO_VISION_COMPONENT", "PLACEHOLDERS", "Vision", "place", "vision_support"]
