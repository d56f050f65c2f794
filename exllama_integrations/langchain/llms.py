"""LangChain ``BaseLLM`` over any ExLlama Runtime (in process, or a server through ``base_url``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from langchain_core.runnables import RunnableSerializable
from langchain_core.runnables.utils import AnyConfigurableField

from ..chat.prepare import ChatRequest, prepare_chat
from ..contract.api import Batching, GenerationRequest, GenerationResult
from ..contract.settings import GenerationSettings
from ..contract.shapes import metadata
from ..errors import InvalidSettingsError
from ..runtime.base import acollect, run_batch, whole
from .mixin import ExLlamaLangChainMixin, lc_chunk, listens_for_tokens

_HF_TASKS = ("text-generation",)
# HuggingFacePipeline pipeline_kwargs that map onto our fields one to one.
_HF_SAME = ("max_new_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "typical_p", "min_p", "seed")


class ExLlamaLLM(ExLlamaLangChainMixin, BaseLLM):
    r"""ExLlama as a LangChain LLM: real token streaming, native token counts, shared loaded model.

    Example:
        .. code-block:: python

            from langchain_core.prompts import PromptTemplate
            from langchain_core.output_parsers import StrOutputParser
            from exllama_integrations.langchain import ExLlamaLLM

            llm = ExLlamaLLM(model_dir="/models/Llama-3-8B-exl3", temperature=0, max_new_tokens=64)
            chain = PromptTemplate.from_template("Q: {q}\\nA:") | llm | StrOutputParser()
            for piece in chain.stream({"q": "What is the capital of France?"}):
                print(piece, end="", flush=True)
            llm.get_num_tokens("How many tokens is this?")  # the model's own tokenizer
    """

    return_full_text: bool = False
    """Prepend the prompt to the output (HuggingFacePipeline's ``return_full_text``)."""
    use_chat_template: bool = False
    """Send each prompt as one user turn through the model's chat template (for instruct models)."""

    @property
    def _llm_type(self) -> str:
        return "exllama"

    def configurable_fields(self, **kwargs: AnyConfigurableField) -> RunnableSerializable[Any, str]:
        """LangChain's ``configurable_fields``, by any name the constructor takes (``max_tokens``, ``num_predict``).

        Raises:
            InvalidSettingsError: a name that sets no field, with the name to use.
        """
        return super().configurable_fields(**{self.configurable_name(k): v for k, v in kwargs.items()})

    # ----------------------------------------------------------------- generation

    def _request(self, prompt: str, settings: GenerationSettings) -> GenerationRequest:
        """The request for one prompt: as it is, or as one user turn through the chat template."""
        if not self.use_chat_template:
            return GenerationRequest(prompt, settings)
        chat = ChatRequest(
            messages=[{"role": "user", "content": prompt}],
            settings=settings,
            template_kwargs=self.chat_template_kwargs,
            chat_template=self.chat_template,
            split_special_tokens=self.split_special_tokens,
            reasoning_tags=self.reasoning_tags,
        )
        return prepare_chat(self._runtime, chat).request

    async def _arequest(self, prompt: str, settings: GenerationSettings) -> GenerationRequest:
        """:meth:`_request` off the event loop when it renders a template (plain text needs no thread)."""
        if not self.use_chat_template:
            return self._request(prompt, settings)
        return await asyncio.to_thread(self._request, prompt, settings)

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        settings = self._settings(stop, kwargs)
        info = self._runtime.model_info()
        if self.return_full_text:
            yield self._emit(GenerationChunk(text=prompt), run_manager)
        with self._runtime.open(self._request(prompt, settings)) as stream:
            for chunk in stream:
                yield self._emit(lc_chunk(chunk, info.name, info.backend, settings.logprobs is not None), run_manager)

    @staticmethod
    def _emit(chunk: GenerationChunk, run_manager: CallbackManagerForLLMRun | None) -> GenerationChunk:
        if run_manager is not None and chunk.text:
            run_manager.on_llm_new_token(chunk.text, chunk=chunk)
        return chunk

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        settings = self._settings(stop, kwargs)
        info = self._runtime.model_info()
        if self.return_full_text:
            first = GenerationChunk(text=prompt)
            if run_manager is not None:
                await run_manager.on_llm_new_token(first.text, chunk=first)
            yield first
        agen = self._runtime.aopen(await self._arequest(prompt, settings))
        try:
            async for chunk in agen:
                lc = lc_chunk(chunk, info.name, info.backend, settings.logprobs is not None)
                if run_manager is not None and lc.text:
                    await run_manager.on_llm_new_token(lc.text, chunk=lc)
                yield lc
        finally:
            await agen.aclose()  # type: ignore[attr-defined]

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        if len(prompts) == 1 and listens_for_tokens(run_manager):
            final: GenerationChunk | None = None
            for chunk in self._stream(prompts[0], stop, run_manager, **kwargs):
                final = chunk if final is None else final + chunk
            assert final is not None
            gens = [[Generation(text=final.text, generation_info=final.generation_info)]]
        else:
            # Whole completions (several prompts: handed to the runtime together, one dynamic batch on exllamav3).
            settings = self._settings(stop, kwargs)
            results = run_batch(self._runtime, [self._request(p, settings) for p in prompts])
            gens = [[self._generation(p, r)] for r, p in zip(results, prompts)]
        return LLMResult(generations=gens, llm_output=self._llm_output(gens))

    def _generation(self, prompt: str, result: GenerationResult) -> Generation:
        info = self._runtime.model_info()
        md = metadata(result, model_name=info.name, backend=info.backend, logprobs=result.logprobs)
        if result.reasoning:
            md["reasoning_content"] = result.reasoning
        return Generation(text=(prompt if self.return_full_text else "") + result.text, generation_info=md)

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        settings = self._settings(stop, kwargs)  # the same for every prompt

        async def one(prompt: str, manager: AsyncCallbackManagerForLLMRun | None) -> Generation:
            if not listens_for_tokens(manager):
                request = whole(await self._arequest(prompt, settings))
                result = await acollect(self._runtime.aopen(request), self._runtime.model_info().backend)
                return self._generation(prompt, result)
            final: GenerationChunk | None = None
            async for chunk in self._astream(prompt, stop, manager, **kwargs):
                final = chunk if final is None else final + chunk
            assert final is not None
            return Generation(text=final.text, generation_info=final.generation_info)

        manager = run_manager if len(prompts) == 1 else None
        if isinstance(self._runtime, Batching):
            self._runtime.expect(len(prompts))  # they reach the runtime one by one: let them prefill together
        gens = [[g] for g in await asyncio.gather(*(one(p, manager) for p in prompts))]
        return LLMResult(generations=gens, llm_output=self._llm_output(gens))

    def _llm_output(self, gens: list[list[Generation]]) -> dict[str, Any]:
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        for g in gens:
            counts = (g[0].generation_info or {}).get("usage") or {}
            for k in usage:
                usage[k] += int(counts.get(k, 0))
        return {"token_usage": usage, "model_name": self.model_name}

    # ----------------------------------------------------------------- HuggingFacePipeline drop-in

    @classmethod
    def from_model_id(
        cls,
        model_id: str,
        task: str = "text-generation",
        backend: str = "default",
        device: int | str | None = None,
        device_map: str | None = None,
        model_kwargs: dict[str, Any] | None = None,
        pipeline_kwargs: dict[str, Any] | None = None,
        batch_size: int | None = None,
        **kwargs: Any,
    ) -> ExLlamaLLM:
        """Build from HuggingFacePipeline.from_model_id's arguments: swap the class name, keep the call.

        ``model_id`` is a local model directory or a Hub id (``org/name``, taken through huggingface_hub's
        cache; only configs, tokenizers and safetensors are downloaded). ``device=-1``
        or ``"cpu"`` selects the CPU reference backend; a GPU index keeps ExLlama. ``pipeline_kwargs``
        (max_new_tokens, temperature, top_p, top_k, do_sample, repetition_penalty, return_full_text)
        become our fields; ``do_sample=False`` (transformers' default) means greedy.
        ``batch_size`` is accepted and unused: ExLlama batches dynamically.

        Raises:
            InvalidSettingsError: a task other than text-generation, trust_remote_code, or an
                argument with no ExLlama meaning.
        """
        if task not in _HF_TASKS:
            raise InvalidSettingsError(
                f"task {task!r} is not supported; ExLlamaLLM does text-generation (causal LMs) only."
            )
        mk = dict(model_kwargs or {})
        if mk.pop("trust_remote_code", False):
            raise InvalidSettingsError("trust_remote_code is never enabled; the model must be a built-in architecture.")
        pk = dict(pipeline_kwargs or {})
        fields: dict[str, Any] = {}
        do_sample = pk.pop("do_sample", None)
        for key in _HF_SAME:
            if key in pk:
                fields["typical" if key == "typical_p" else key] = pk.pop(key)
        if "return_full_text" in pk:
            fields["return_full_text"] = bool(pk.pop("return_full_text"))
        if not do_sample:
            fields["temperature"] = 0.0
        pk.pop("pad_token_id", None)
        pk.pop("eos_token_id", None)
        if pk:
            raise InvalidSettingsError(f"pipeline_kwargs not supported by ExLlamaLLM: {', '.join(sorted(pk))}.")
        dtype = mk.pop("torch_dtype", mk.pop("dtype", None))
        if dtype is not None:
            fields["dtype"] = str(dtype).replace("torch.", "")
        if backend not in ("default", "auto"):
            fields["backend"] = backend
        if device in (-1, "cpu"):
            fields["backend"] = "transformers"  # resolves to the same shared runtime as "auto" on a CPU machine
        elif isinstance(device, int) and device >= 0:
            fields["device"] = f"cuda:{device}"
        elif isinstance(device, str):
            fields["device"] = device
        del device_map, batch_size  # ExLlama places layers and batches itself
        return cls(model_dir=model_id, **fields, **kwargs)
