"""LlamaIndex ``FunctionCallingLLM`` over any ExLlama Runtime: native chat, real async, exact token counts, tools.

Types only: chat itself (rendering, tools, grammars, tool-tag hold-back, finish reasons, metadata)
is decided in :mod:`exllama_integrations.runtime.chat`, the same as for LangChain and the server.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
    TextBlock,
    ThinkingBlock,
)
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection

from .._adapter import ExLlamaConfig
from ..chat.outcome import ChatDelta, ChatOutcome, ParsedToolCall, astream_chat, stream_chat
from ..chat.prepare import ChatRequest, PreparedChat, aprepare_chat, prepare_chat
from ..contract.api import GenerationRequest, Media, StreamChunk
from ..contract.settings import GenerationSettings
from ..contract.shapes import metadata
from .messages import alast_response, is_custom_messages_to_prompt, last_response, li_logprobs, template_messages

if TYPE_CHECKING:
    from llama_index.core.tools.types import BaseTool
    from pydantic import BaseModel

# What LlamaIndex itself passes through chat(**kwargs) that is not a generation setting.
_CHAT_KWARGS = ("tools", "tool_choice", "json_schema", "parallel_tool_calls")


class ExLlamaLLM(ExLlamaConfig, FunctionCallingLLM):
    """ExLlama as a LlamaIndex LLM (completion, chat, streaming, async, tools, structured output).

    Shares the loaded runtime with the LangChain classes built on the same model directory; with
    ``base_url=`` it uses a server's model instead, with the same behaviour.

    Example:
        .. code-block:: python

            from llama_index.core import Settings, SummaryIndex, Document
            from exllama_integrations.llama_index import ExLlamaLLM

            llm = ExLlamaLLM(model_dir="/models/Llama-3.1-8B-Instruct-exl3", temperature=0)
            Settings.llm = llm
            Settings.tokenizer = llm.tokenizer_fn  # TokenCountingHandler counts with the model's tokenizer
            index = SummaryIndex.from_documents([Document(text="Paris is the capital of France.")])
            print(index.as_query_engine().query("What is the capital of France?"))
    """

    @classmethod
    def _normalize_init(cls, data: dict[str, Any]) -> dict[str, Any]:
        data = dict(data)
        if "context_window" in data:  # LlamaIndex's name for the context to allocate
            data.setdefault("max_seq_len", data.pop("context_window"))
        return super()._normalize_init(data)

    @classmethod
    def class_name(cls) -> str:
        return "ExLlamaLLM"

    @property
    def metadata(self) -> LLMMetadata:
        """Read from the loaded model: context window (cache size), chat template, tool support."""
        info = self._runtime.model_info()
        return LLMMetadata(
            context_window=info.context_length,
            num_output=self.max_new_tokens or GenerationSettings().max_new_tokens or 256,
            is_chat_model=info.has_chat_template or self.chat_template is not None,
            is_function_calling_model=True,
            model_name=info.name,
        )

    @property
    def tokenizer_fn(self) -> Callable[[str], list[int]]:
        """A tokenizer callable for ``Settings.tokenizer`` / ``TokenCountingHandler``: the model's own."""
        rt = self._runtime
        return lambda text: rt.encode(text)

    # ----------------------------------------------------------------- completion

    def _completion_prompt(self, prompt: str, formatted: bool) -> str:
        if not formatted:
            prompt = self.completion_to_prompt(prompt) if self.completion_to_prompt else prompt
            if self.system_prompt:
                prompt = f"{self.system_prompt}\n\n{prompt}"
        return prompt

    def _completion(self, acc: str, chunk: StreamChunk) -> CompletionResponse:
        raw: dict[str, Any] = {}
        if chunk.finish_reason is not None:
            info = self._runtime.model_info()
            raw = metadata(chunk, model_name=info.name, backend=info.backend)
        extra = {"thinking_delta": chunk.reasoning} if chunk.reasoning else {}
        return CompletionResponse(
            text=acc, delta=chunk.text, raw=raw, logprobs=li_logprobs(chunk.logprobs), additional_kwargs=extra
        )

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Complete ``prompt``; ``raw["usage"]`` holds exact token counts."""
        # The undecorated generator: going through stream_complete would fire the callbacks twice.
        return last_response(self._stream_complete(prompt, formatted, kwargs, incremental=False), all_logprobs=True)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        """Stream a completion: cumulative ``text`` and ``delta``; usage on the last response."""
        return self._stream_complete(prompt, formatted, kwargs)

    def _stream_complete(
        self, prompt: str, formatted: bool, kwargs: dict[str, Any], incremental: bool = True
    ) -> CompletionResponseGen:
        settings = self._call_settings(None, kwargs)
        text = self._completion_prompt(prompt, formatted)

        request = GenerationRequest(text, settings, incremental=incremental)

        def gen() -> CompletionResponseGen:
            acc = ""
            with self._runtime.open(request) as stream:
                for chunk in stream:
                    acc += chunk.text
                    if chunk.text or chunk.reasoning or chunk.logprobs or chunk.finish_reason is not None:
                        yield self._completion(acc, chunk)

        return gen()

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Async :meth:`complete`; decoding runs off the event loop."""
        return await alast_response(
            self._astream_complete(prompt, formatted, kwargs, incremental=False), all_logprobs=True
        )

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        """Async :meth:`stream_complete`; the event loop stays free."""
        return self._astream_complete(prompt, formatted, kwargs)

    def _astream_complete(
        self, prompt: str, formatted: bool, kwargs: dict[str, Any], incremental: bool = True
    ) -> CompletionResponseAsyncGen:
        settings = self._call_settings(None, kwargs)
        text = self._completion_prompt(prompt, formatted)

        request = GenerationRequest(text, settings, incremental=incremental)

        async def gen() -> CompletionResponseAsyncGen:
            acc = ""
            agen = self._runtime.aopen(request)
            try:
                async for chunk in agen:
                    acc += chunk.text
                    if chunk.text or chunk.reasoning or chunk.logprobs or chunk.finish_reason is not None:
                        yield self._completion(acc, chunk)
            finally:
                await agen.aclose()  # type: ignore[attr-defined]

        return gen()

    # ----------------------------------------------------------------- chat

    def _chat_request(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatRequest:
        kwargs = dict(kwargs)
        bound = {k: kwargs.pop(k, None) for k in _CHAT_KWARGS}
        template_kwargs = self._template_kwargs(kwargs.pop("chat_template_kwargs", None))
        settings = self._call_settings(None, kwargs)
        msgs = list(messages)
        if self.system_prompt and not any(m.role == MessageRole.SYSTEM for m in msgs):
            msgs = [ChatMessage(role=MessageRole.SYSTEM, content=self.system_prompt), *msgs]
        schema = bound["json_schema"]
        to_prompt = self.messages_to_prompt
        media: list[Media] = []
        return ChatRequest(
            messages=template_messages(msgs, media),
            settings=settings,
            tools=bound["tools"] or (),
            tool_choice=bound["tool_choice"],
            response_format={"type": "json_schema", "json_schema": {"schema": schema}} if schema is not None else None,
            template_kwargs=template_kwargs,
            chat_template=self.chat_template,
            prompt=to_prompt(msgs) if to_prompt is not None and is_custom_messages_to_prompt(to_prompt) else None,
            split_special_tokens=self.split_special_tokens,
            reasoning_tags=self.reasoning_tags,
            media=media,
            tool_format=self.tool_format,
            parallel_tool_calls=bound["parallel_tool_calls"],
        )

    def _prepare(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> PreparedChat:
        return prepare_chat(self._runtime, self._chat_request(messages, kwargs))

    @staticmethod
    def _chat_response(acc: str, item: ChatDelta | ChatOutcome, calls: list[ParsedToolCall]) -> ChatResponse:
        """One response of a chat stream; ``calls``: the reply's calls so far (this item's added to it).

        Every response carries the valid calls so far in ``additional_kwargs["tool_calls"]`` (OpenAI's shape, as
        LlamaIndex's agents read them); a call that did not read is never among them: it is kept with its raw
        text and the reason in ``additional_kwargs["invalid_tool_calls"]`` (one ``max_tokens`` cut short with its
        ``arguments`` as far as they got).
        """
        calls.extend(item.tool_calls if isinstance(item, ChatDelta) else item.tool_calls[len(calls) :])
        kwargs: dict[str, Any] = {}
        valid = [c for c in calls if c.error is None]
        if valid:
            kwargs["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_text}}
                for c in valid
            ]
        invalid = [
            {"id": c.id, "name": c.name, "raw": c.raw, "error": c.error, "arguments": c.written if c.cut else None}
            for c in calls
            if c.error is not None
        ]
        if invalid:
            kwargs["invalid_tool_calls"] = invalid
        if isinstance(item, ChatDelta):
            msg = ChatMessage(role=MessageRole.ASSISTANT, content=acc, additional_kwargs=kwargs)
            extra = {"thinking_delta": item.reasoning} if item.reasoning else {}
            return ChatResponse(
                message=msg, delta=item.text, logprobs=li_logprobs(item.logprobs), additional_kwargs=extra
            )
        blocks: list[Any] = [TextBlock(text=item.content)]
        if item.reasoning:
            blocks.insert(0, ThinkingBlock(content=item.reasoning, num_tokens=item.usage.reasoning_tokens))
        msg = ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks, additional_kwargs=kwargs)
        extra = {"thinking_delta": item.reasoning_tail} if item.reasoning_tail else {}
        return ChatResponse(
            message=msg,
            delta=item.tail,
            raw=item.metadata,
            logprobs=li_logprobs(item.logprobs),
            additional_kwargs=extra,
        )

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """Chat through the model's own template (not through complete); ``raw["usage"]`` is exact."""
        *_, outcome = self._stream_chat(messages, kwargs, incremental=False)
        return outcome  # it carries every token's logprobs already (gathering the deltas' too counted each twice)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        """Stream a chat reply; tool-call text is held back; tool calls and usage arrive on the last response."""
        return self._stream_chat(messages, kwargs)

    def _stream_chat(
        self, messages: Sequence[ChatMessage], kwargs: dict[str, Any], incremental: bool = True
    ) -> ChatResponseGen:
        prepared = self._prepare(messages, kwargs)

        def gen() -> ChatResponseGen:
            acc, calls = "", list[ParsedToolCall]()
            for item in stream_chat(self._runtime, prepared, incremental=incremental):
                acc += item.text if isinstance(item, ChatDelta) else ""
                yield self._chat_response(acc, item, calls)

        return gen()

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """Async :meth:`chat`; rendering and decoding run off the event loop."""
        async for outcome in self._astream_chat(messages, kwargs, incremental=False):  # noqa: B007 - the last
            pass
        return outcome  # every token's logprobs, once (as in chat)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        """Async :meth:`stream_chat`; the event loop stays free."""
        return self._astream_chat(messages, kwargs)

    def _astream_chat(
        self, messages: Sequence[ChatMessage], kwargs: dict[str, Any], incremental: bool = True
    ) -> ChatResponseAsyncGen:
        request = self._chat_request(messages, kwargs)

        async def gen() -> ChatResponseAsyncGen:
            prepared = await aprepare_chat(self._runtime, request)
            acc, calls = "", list[ParsedToolCall]()
            async for item in astream_chat(self._runtime, prepared, incremental=incremental):
                acc += item.text if isinstance(item, ChatDelta) else ""
                yield self._chat_response(acc, item, calls)

        return gen()

    # ----------------------------------------------------------------- function calling

    def _prepare_chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: Any = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Messages plus OpenAI-format tool specs; ``tool_required`` forces a (grammar-valid) call."""
        specs = [t.metadata.to_openai_tool() for t in tools]
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(
                user_msg if isinstance(user_msg, ChatMessage) else ChatMessage(role="user", content=user_msg)
            )
        if tool_choice is None:
            tool_choice = "required" if tool_required else "auto"
        return {
            "messages": messages,
            "tools": specs or None,
            "tool_choice": tool_choice,
            "parallel_tool_calls": allow_parallel_tool_calls,
            **kwargs,
        }

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        """Tool calls of a chat response, as ToolSelections."""
        calls = response.message.additional_kwargs.get("tool_calls") or []
        if not calls and error_on_no_tool_call:
            raise ValueError(f"expected at least one tool call, got none: {response.message.content!r}")
        out = []
        for c in calls:
            try:
                args = json.loads(c["function"].get("arguments") or "{}")
            except json.JSONDecodeError:
                args = {}
            out.append(ToolSelection(tool_id=c["id"], tool_name=c["function"]["name"] or "", tool_kwargs=args))
        return out

    # ----------------------------------------------------------------- structured output

    def structured_predict(
        self, output_cls: type[BaseModel], prompt: Any, llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any
    ) -> BaseModel:
        """Predict an ``output_cls`` with a JSON-schema grammar: the reply always parses when it completes."""
        messages = prompt.format_messages(llm=self, **prompt_args)
        response = self.chat(messages, json_schema=output_cls.model_json_schema(), **(llm_kwargs or {}))
        return output_cls.model_validate_json(response.message.content or "")

    async def astructured_predict(
        self, output_cls: type[BaseModel], prompt: Any, llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any
    ) -> BaseModel:
        """Async :meth:`structured_predict`."""
        messages = prompt.format_messages(llm=self, **prompt_args)
        response = await self.achat(messages, json_schema=output_cls.model_json_schema(), **(llm_kwargs or {}))
        return output_cls.model_validate_json(response.message.content or "")
