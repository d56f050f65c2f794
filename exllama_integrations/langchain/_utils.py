"""What the LangChain classes share beyond the common configuration: tracing params and call settings."""

from __future__ import annotations

from typing import Any

from langchain_core.callbacks import AsyncCallbackHandler, BaseCallbackHandler
from langchain_core.outputs import GenerationChunk

from .._adapter import SETTING_FIELDS, ExLlamaConfig, as_stops
from ..runtime.api import StreamChunk
from ..runtime.chat_outcome import logprobs_content, metadata

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
    """Tracing and identifying params of ExLlamaLLM and ChatExLlama (not a LangChain class by itself)."""

    def _settings(self, stop: list[str] | str | None, kwargs: dict[str, Any]) -> Any:
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


def lc_chunk(chunk: StreamChunk, model_name: str, backend: str, wants_logprobs: bool) -> GenerationChunk:
    """A runtime chunk as LangChain's: logprobs per chunk (they concatenate), metadata on the last."""
    info: dict[str, Any] | None = None
    if chunk.logprobs:
        info = {"logprobs": {"content": logprobs_content(chunk.logprobs)}}
    if chunk.finish_reason is not None:
        info = {**(info or {}), **metadata(chunk, model_name=model_name, backend=backend)}
        if wants_logprobs and "logprobs" not in info:
            info["logprobs"] = {"content": []}  # the key is always there when asked for (batch results agree)
    return GenerationChunk(text=chunk.text, generation_info=info)
