"""What a loaded chat model is, as :class:`~...contract.api.ModelInfo` says it: read once, when it has loaded."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...chat.formats import find_format, response_template_of, template_details
from ...chat.reasoning import find_reasoning
from ...contract.api import ModelInfo
from ...model.directory import ModelDirectory
from ...model.tokenizer import NativeTokenizer

if TYPE_CHECKING:
    from ...backends.base import Backend


def model_facts(
    model: ModelDirectory,
    tokenizer: NativeTokenizer,
    backend: Backend,
    backend_name: str,
    load_seconds: float,
    refused: dict[str, Any],
) -> ModelInfo:
    """The loaded model's facts: name, backend, context, tokens, template, tool format, reasoning, batching, refusals.

    ``refused``: the settings its backend cannot honour, each with why.
    """
    template = tokenizer.chat_template
    return ModelInfo(
        name=model.name,
        backend=backend_name,
        context_length=backend.context_length,
        vocab_size=tokenizer.vocab_size,
        eos_token_ids=tuple(tokenizer.eos_token_ids),
        bos_token_id=tokenizer.bos_token_id,
        has_chat_template=template is not None,
        renders_tools="tools" in (template or ""),
        tool_format=find_format(template).name,
        max_batch_size=backend.max_batch_size,
        unsupported_settings=refused,
        reasoning=find_reasoning(template),
        accepts_images=backend.vision is None,
        details={
            "model_dir": str(model.path),
            "load_seconds": round(load_seconds, 3),
            **template_details(response_template_of(model.tokenizer_config)),  # the model's own call parser
            **backend.info(),
        },
    )


__all__ = ["model_facts"]
