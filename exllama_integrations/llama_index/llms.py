"""LlamaIndex ``LLM`` over an ExLlama runtime: native chat, real async, exact token counts, tools."""

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
)
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from pydantic import Field, PrivateAttr

from ..errors import ConstraintViolationError, InvalidSettingsError
from ..runtime import ExLlamaRuntime, GenerationChunk, GenerationSettings
from ..runtime.chat import (
    ChatRequest,
    build_chat_request,
    parse_tool_calls,
    renders_tools,
    tool_call_text,
    tool_response_text,
)
from ..runtime.settings import SAMPLING_FIELDS, call_overrides

if TYPE_CHECKING:
    from llama_index.core.tools.types import BaseTool
    from pydantic import BaseModel


def _text(message: ChatMessage) -> str:
    parts = []
    for block in message.blocks:
        kind = getattr(block, "block_type", "text")
        if kind == "text":
            parts.append(block.text)  # type: ignore[union-attr]
        elif kind not in ("tool_call", "thinking"):
            raise InvalidSettingsError(
                f"message blocks of type {kind!r} are not supported: this model takes text only."
            )
    return "".join(parts)


def _template_messages(messages: Sequence[ChatMessage], native_tools: bool) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.role.value if isinstance(m.role, MessageRole) else str(m.role)
        text = _text(m)
        calls = m.additional_kwargs.get("tool_calls") or []
        if role == MessageRole.ASSISTANT.value and calls:
            parsed = [(c["function"]["name"], _args(c["function"].get("arguments"))) for c in calls]
            if native_tools:
                out.append(
                    {
                        "role": "assistant",
                        "content": text,
                        "tool_calls": [
                            {"id": c.get("id"), "type": "function", "function": {"name": n, "arguments": a}}
                            for c, (n, a) in zip(calls, parsed)
                        ],
                    }
                )
            else:
                out.append(
                    {
                        "role": "assistant",
                        "content": (text + "\n" if text else "") + "".join(tool_call_text(n, a) for n, a in parsed),
                    }
                )
            continue
        if role in (MessageRole.TOOL.value, MessageRole.FUNCTION.value):
            if native_tools:
                out.append({"role": "tool", "content": text, "tool_call_id": m.additional_kwargs.get("tool_call_id")})
            else:
                out.append({"role": "user", "content": tool_response_text(text)})
            continue
        if role in (MessageRole.DEVELOPER.value,):
            role = "system"
        out.append({"role": role, "content": text})
    return out


def _args(a: Any) -> dict[str, Any]:
    if isinstance(a, dict):
        return a
    try:
        v = json.loads(a or "{}")
    except json.JSONDecodeError:
        return {}
    return v if isinstance(v, dict) else {}


def _usage(chunk: GenerationChunk) -> dict[str, Any]:
    assert chunk.usage is not None and chunk.timings is not None
    return {
        "usage": {
            "prompt_tokens": chunk.usage.prompt_tokens,
            "completion_tokens": chunk.usage.completion_tokens,
            "total_tokens": chunk.usage.total_tokens,
        },
        "finish_reason": chunk.finish_reason,
        "time_to_first_token": chunk.timings.time_to_first_token,
        "tokens_per_second": chunk.timings.tokens_per_second,
    }


class ExLlamaLLM(FunctionCallingLLM):
    """ExLlama as a LlamaIndex LLM (completion, chat, streaming, async, tools, structured output).

    Shares the loaded runtime with the LangChain classes built on the same model directory.

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

    model_dir: str | None = Field(default=None, description="Model directory (or pass runtime=).")
    backend: str = Field(default="auto", description="auto, exllamav3, exllama, exllamav2 or transformers.")
    max_new_tokens: int | None = Field(default=None, description="Most tokens to generate (runtime default 256).")
    temperature: float | None = Field(default=None, description="Sampling temperature; 0 is greedy.")
    top_k: int | None = Field(default=None, description="Top-k truncation; 0 disables.")
    top_p: float | None = Field(default=None, description="Nucleus sampling mass; 1.0 disables.")
    min_p: float | None = Field(default=None, description="Min-p truncation; 0 disables.")
    typical: float | None = Field(default=None, description="Locally typical sampling; 1.0 disables.")
    repetition_penalty: float | None = Field(default=None, description="Repetition penalty; 1.0 disables.")
    no_repeat_ngram_size: int | None = Field(default=None, description="Never repeat an n-gram this long.")
    seed: int | None = Field(default=None, description="Sampling seed.")
    stop: list[str] | None = Field(default=None, description="Stop strings, never part of the output.")
    max_seq_len: int | None = Field(default=None, description="Context (cache) length to allocate.")
    dtype: str | None = Field(default=None, description="Weights dtype for backends that take one.")
    device: str | None = Field(default=None, description="Device for backends that take one.")
    backend_options: dict[str, Any] = Field(default_factory=dict, description="Backend-specific load options.")
    shared_runtime: bool = Field(default=True, description="Reuse the runtime loaded for this directory.")
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict, description="Extra chat template variables.")

    _runtime: ExLlamaRuntime = PrivateAttr()

    def __init__(self, runtime: ExLlamaRuntime | None = None, **kwargs: Any) -> None:
        """Load (or borrow) the runtime; bad settings and model directories raise typed errors here."""
        super().__init__(**kwargs)
        if runtime is None and not self.model_dir:
            raise InvalidSettingsError("pass model_dir='path/to/model' or runtime=ExLlamaRuntime(...).")
        self._settings({})  # bad settings fail here, before anything loads
        if runtime is None:
            assert self.model_dir is not None
            factory = ExLlamaRuntime.shared if self.shared_runtime else ExLlamaRuntime
            runtime = factory(
                self.model_dir,
                self.backend,
                max_seq_len=self.max_seq_len,
                dtype=self.dtype,
                device=self.device,
                **self.backend_options,
            )
        self._runtime = runtime

    @classmethod
    def class_name(cls) -> str:
        return "ExLlamaLLM"

    @property
    def exllama_runtime(self) -> ExLlamaRuntime:
        """The loaded runtime."""
        return self._runtime

    @property
    def metadata(self) -> LLMMetadata:
        """Read from the loaded model: context window (cache size), chat template, tool support."""
        rt = self._runtime
        return LLMMetadata(
            context_window=rt.context_length,
            num_output=self.max_new_tokens or GenerationSettings().max_new_tokens or 256,
            is_chat_model=rt.tokenizer.chat_template is not None,
            is_function_calling_model=True,
            model_name=rt.model_name,
        )

    @property
    def tokenizer_fn(self) -> Callable[[str], list[int]]:
        """A tokenizer callable for ``Settings.tokenizer`` / ``TokenCountingHandler``: the model's own."""
        rt = self._runtime
        return lambda text: rt.encode(text)

    # ----------------------------------------------------------------- settings

    def _settings(self, kwargs: dict[str, Any]) -> GenerationSettings:
        """Runtime defaults < instance fields < call kwargs (other kwargs ignored); stops unioned."""
        overrides = call_overrides({k: getattr(self, k) for k in SAMPLING_FIELDS}, kwargs, self.stop or [])
        if hasattr(self, "_runtime"):
            return self._runtime.resolve_settings(None, **overrides)
        return GenerationSettings().merged(**overrides)  # at construction, before the runtime exists

    # ----------------------------------------------------------------- completion

    def _completion_prompt(self, prompt: str, formatted: bool) -> str:
        if not formatted:
            prompt = self.completion_to_prompt(prompt) if self.completion_to_prompt else prompt
            if self.system_prompt:
                prompt = f"{self.system_prompt}\n\n{prompt}"
        return prompt

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Complete ``prompt``; ``raw["usage"]`` holds exact token counts."""
        # The undecorated generator: going through stream_complete would fire the callbacks twice.
        last = None
        for last in self._stream_complete(prompt, formatted, kwargs):  # noqa: B007 - keep the last
            pass
        assert last is not None
        return last

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        """Stream a completion: cumulative ``text`` and ``delta``; usage on the last response."""
        return self._stream_complete(prompt, formatted, kwargs)

    def _stream_complete(self, prompt: str, formatted: bool, kwargs: dict[str, Any]) -> CompletionResponseGen:
        settings = self._settings(kwargs)
        text = self._completion_prompt(prompt, formatted)

        def gen() -> CompletionResponseGen:
            acc = ""
            with self._runtime.stream(text, settings) as stream:
                for chunk in stream:
                    acc += chunk.text
                    raw = _usage(chunk) if chunk.finish_reason is not None else {}
                    if chunk.text or raw:
                        yield CompletionResponse(text=acc, delta=chunk.text, raw=raw)

        return gen()

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Async :meth:`complete`; decoding runs off the event loop."""
        last = None
        async for last in self._astream_complete(prompt, formatted, kwargs):  # noqa: B007
            pass
        assert last is not None
        return last

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        """Async :meth:`stream_complete`; the event loop stays free."""
        return self._astream_complete(prompt, formatted, kwargs)

    def _astream_complete(self, prompt: str, formatted: bool, kwargs: dict[str, Any]) -> CompletionResponseAsyncGen:
        settings = self._settings(kwargs)
        text = self._completion_prompt(prompt, formatted)

        async def gen() -> CompletionResponseAsyncGen:
            acc = ""
            async for chunk in self._runtime.astream(text, settings):
                acc += chunk.text
                raw = _usage(chunk) if chunk.finish_reason is not None else {}
                if chunk.text or raw:
                    yield CompletionResponse(text=acc, delta=chunk.text, raw=raw)

        return gen()

    # ----------------------------------------------------------------- chat

    def _chat_request(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> tuple[ChatRequest, Any]:
        kwargs = dict(kwargs)
        tools = kwargs.pop("tools", None)
        tool_choice = kwargs.pop("tool_choice", None)
        schema = kwargs.pop("json_schema", None)
        settings = self._settings(kwargs)
        msgs = list(messages)
        if self.system_prompt and not any(m.role == MessageRole.SYSTEM for m in msgs):
            msgs = [ChatMessage(role=MessageRole.SYSTEM, content=self.system_prompt), *msgs]
        if self.messages_to_prompt is not None and not _is_default_messages_to_prompt(self.messages_to_prompt):
            req = ChatRequest(self.messages_to_prompt(msgs))  # the user's own formatting wins
        else:
            req = build_chat_request(
                self._runtime,
                _template_messages(msgs, renders_tools(self._runtime)),
                tools=tools,
                tool_choice=tool_choice,
                json_schema=schema,
                template_kwargs=self.chat_template_kwargs,
            )
        return req, req.settings_for(settings)

    def _chat_response(self, req: ChatRequest, acc: str, delta: str, chunk: GenerationChunk) -> ChatResponse:
        kwargs: dict[str, Any] = {}
        raw: dict[str, Any] = {}
        content = acc
        if chunk.finish_reason is not None:
            raw = _usage(chunk)
            if req.constraint is not None and chunk.constraint_complete is False:
                raise ConstraintViolationError(
                    f"the constrained output was cut at max_new_tokens before it was complete ({acc[-80:]!r}); "
                    "raise max_new_tokens."
                )
            if req.tools_active:
                content, calls = parse_tool_calls(acc)
                if calls:
                    kwargs["tool_calls"] = [
                        {
                            "id": c.id,
                            "type": "function",
                            "function": {
                                "name": c.name,
                                "arguments": c.raw if c.error else json.dumps(c.arguments, ensure_ascii=False),
                            },
                        }
                        for c in calls
                    ]
        msg = ChatMessage(role=MessageRole.ASSISTANT, content=content, additional_kwargs=kwargs)
        return ChatResponse(message=msg, delta=delta, raw=raw)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """Chat through the model's own template (not through complete); ``raw["usage"]`` is exact."""
        last = None
        for last in self._stream_chat(messages, kwargs):  # noqa: B007 - keep the last
            pass
        assert last is not None
        return last

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        """Stream a chat reply; tool calls and usage arrive on the last response."""
        return self._stream_chat(messages, kwargs)

    def _stream_chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponseGen:
        req, settings = self._chat_request(messages, kwargs)

        def gen() -> ChatResponseGen:
            acc = ""
            with self._runtime.stream(
                req.prompt, settings, constraint=req.constraint, add_special_tokens=False
            ) as stream:
                for chunk in stream:
                    acc += chunk.text
                    if chunk.text or chunk.finish_reason is not None:
                        yield self._chat_response(req, acc, chunk.text, chunk)

        return gen()

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """Async :meth:`chat`; decoding runs off the event loop."""
        last = None
        async for last in self._astream_chat(messages, kwargs):  # noqa: B007
            pass
        assert last is not None
        return last

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        """Async :meth:`stream_chat`; the event loop stays free."""
        return self._astream_chat(messages, kwargs)

    def _astream_chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponseAsyncGen:
        req, settings = self._chat_request(messages, kwargs)

        async def gen() -> ChatResponseAsyncGen:
            acc = ""
            async for chunk in self._runtime.astream(
                req.prompt, settings, constraint=req.constraint, add_special_tokens=False
            ):
                acc += chunk.text
                if chunk.text or chunk.finish_reason is not None:
                    yield self._chat_response(req, acc, chunk.text, chunk)

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
        return {"messages": messages, "tools": specs or None, "tool_choice": tool_choice, **kwargs}

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        """Tool calls of a chat response, as ToolSelections."""
        calls = response.message.additional_kwargs.get("tool_calls") or []
        if not calls and error_on_no_tool_call:
            raise ValueError(f"expected at least one tool call, got none: {response.message.content!r}")
        return [
            ToolSelection(
                tool_id=c["id"], tool_name=c["function"]["name"], tool_kwargs=_args(c["function"].get("arguments"))
            )
            for c in calls
        ]

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


def _is_default_messages_to_prompt(fn: Any) -> bool:
    from llama_index.core.base.llms.generic_utils import messages_to_prompt as default

    return fn is default or getattr(fn, "__name__", "") == "messages_to_prompt"
