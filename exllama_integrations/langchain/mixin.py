"""What the LangChain classes share beyond the common configuration: call settings, tracing params, the profile.

The profile is LangChain v1's ``ModelProfile``, read from the runtime's model info, so ``create_agent`` picks
native structured output and summarization middleware knows the context window.
"""

from __future__ import annotations

from typing import Any

from langchain_core.callbacks import AsyncCallbackHandler, BaseCallbackHandler
from langchain_core.outputs import GenerationChunk

from .._adapter import SETTING_FIELDS, ExLlamaConfig, as_stops
from ..chat.reasoning import find_reasoning
from ..contract.api import StreamChunk
from ..contract.settings import GenerationSettings
from ..contract.shapes import logprobs_content, metadata

# Arguments LangChain passes that are not generation settings (accepted and ignored here).
IGNORED_CALL_KWARGS = frozenset({"timeout", "max_retries", "streaming", "callbacks", "tags", "run_name", "model"})


_SILENT = (BaseCallbackHandler.on_llm_new_token, AsyncCallbackHandler.on_llm_new_token)


def listens_for_tokens(run_manager: Any) -> bool:
    """Whether a handler of this call receives tokens (its class defines ``on_llm_new_token``).

    ``invoke()``/``generate()`` stream to such handlers (``StreamingStdOutCallbackHandler``, tracers, the
    handlers of ``astream_events``); with none listening, the call reads the whole completion at once,
    which under load spares the decoding thread a wake-up per token.
    """
    handlers = getattr(run_manager, "handlers", None) or ()
    return any(getattr(type(h), "on_llm_new_token", None) not in _SILENT for h in handlers)


class ExLlamaLangChainMixin(ExLlamaConfig):
    """Call settings, tracing and identifying params, and the profile of ExLlamaLLM and ChatExLlama."""

    def _settings(self, stop: list[str] | str | None, kwargs: dict[str, Any]) -> GenerationSettings:
        return self._call_settings(stop, kwargs, IGNORED_CALL_KWARGS)

    @property
    def _identifying_params(self) -> dict[str, Any]:
        info = self._runtime.model_info()
        return {
            "model_name": info.name,
            "backend": info.backend,
            **{k: getattr(self, k) for k in SETTING_FIELDS if getattr(self, k) is not None},
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> Any:
        """LangSmith tracing params, from the settings a call with these arguments would run with."""
        params = super()._get_ls_params(stop=stop, **kwargs)  # type: ignore[misc]  # BaseLLM / BaseChatModel
        known = {k: v for k, v in kwargs.items() if k in SETTING_FIELDS or k in ("max_tokens", "stop")}
        s = self._settings(as_stops(stop), known)
        params.update(
            ls_provider="exllama",
            ls_model_name=kwargs.get("model") or self.model_name,
            ls_temperature=s.temperature,
            ls_max_tokens=s.max_new_tokens,
        )
        if s.stop:
            params["ls_stop"] = s.stop
        return params

    def _profile(self) -> dict[str, Any]:
        """LangChain's ``ModelProfile`` of the loaded model (what it takes and what it can do)."""
        info = self._runtime.model_info()
        out = self.max_new_tokens or GenerationSettings().max_new_tokens or 256
        return {
            "max_input_tokens": info.context_length,
            "max_output_tokens": min(out, info.context_length) if self.max_new_tokens else info.context_length,
            "tool_calling": True,
            "tool_choice": True,
            "structured_output": True,
            "reasoning_output": bool(info.reasoning or self.reasoning_tags or find_reasoning(self.chat_template)),
            "image_inputs": info.accepts_images,
            "image_url_inputs": info.accepts_images,
            "text_inputs": True,
            "text_outputs": True,
            "tool_call_streaming": True,
            "temperature": True,
            "open_weights": True,
        }


def lc_chunk(chunk: StreamChunk, model_name: str, backend: str, wants_logprobs: bool) -> GenerationChunk:
    """A runtime chunk as LangChain's: logprobs per chunk (they concatenate), metadata on the last."""
    info: dict[str, Any] | None = None
    if chunk.logprobs:
        info = {"logprobs": {"content": logprobs_content(chunk.logprobs)}}
    if chunk.reasoning:  # a reasoning model's thinking, apart from the text (deltas add up)
        info = {**(info or {}), "reasoning_content": chunk.reasoning}
    if chunk.finish_reason is not None:
        info = {**(info or {}), **metadata(chunk, model_name=model_name, backend=backend)}
        if wants_logprobs and "logprobs" not in info:
            info["logprobs"] = {"content": []}  # the key is always there when asked for (batch results agree)
    return GenerationChunk(text=chunk.text, generation_info=info)
