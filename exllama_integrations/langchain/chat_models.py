"""LangChain ``BaseChatModel`` over an ExLlama runtime: chat templates, tools, structured output."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.language_models.chat_models import agenerate_from_stream, generate_from_stream
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.output_parsers import JsonOutputKeyToolsParser, JsonOutputParser, PydanticToolsParser
from langchain_core.output_parsers.pydantic import PydanticOutputParser
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel, Field

from ..errors import ConstraintViolationError, InvalidSettingsError
from ..runtime import GenerationChunk as RuntimeChunk
from ..runtime import GenerationSettings
from ..runtime.chat import TOOL_OPEN, ChatRequest, build_chat_request, forced_tools, parse_tool_calls, renders_tools
from ..runtime.streaming import StopStringMatcher
from ._chat_utils import to_template_messages
from ._utils import ExLlamaRuntimeMixin

_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "cancelled"}


class _ChunkBuilder:
    """Runtime chunks -> ChatGenerationChunks; holds back ``<tool_call>`` text when tools are bound."""

    def __init__(self, req: ChatRequest, settings: GenerationSettings, model_name: str, tokenizer: Any) -> None:
        self.req = req
        self.settings = settings
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.raw: list[str] = []
        self.shown = ""
        # With tools bound, text from "<tool_call>" on is held back (it becomes tool_call_chunks); the
        # stop-string matcher holds a partial tag across chunks exactly as it holds a partial stop.
        self._tag = StopStringMatcher([TOOL_OPEN]) if req.tools_active else None

    def _visible(self, text: str) -> str:
        return text if self._tag is None else self._tag.push(text)

    def feed(self, chunk: RuntimeChunk) -> ChatGenerationChunk | None:
        self.raw.append(chunk.text)
        if chunk.finish_reason is None:
            text = self._visible(chunk.text)
            info = self._logprobs(chunk)
            if not text and not info:
                return None
            self.shown += text
            msg = AIMessageChunk(content=text, response_metadata={"logprobs": info} if info else {})
            return ChatGenerationChunk(message=msg)
        return self._final(chunk)

    def _logprobs(self, chunk: RuntimeChunk) -> dict[str, Any] | None:
        if not chunk.logprobs:
            return None
        dec = self.tokenizer.decode
        return {
            "content": [
                {
                    "token": dec([lp.token_id]),
                    "logprob": lp.logprob,
                    "top_logprobs": [{"token": dec([t]), "logprob": v} for t, v in lp.top],
                }
                for lp in chunk.logprobs
            ]
        }

    def _final(self, chunk: RuntimeChunk) -> ChatGenerationChunk:
        assert chunk.usage is not None and chunk.timings is not None
        raw = "".join(self.raw)
        if self.req.constraint is not None and chunk.constraint_complete is False:
            raise ConstraintViolationError(
                f"the constrained output was cut at max_tokens={self.settings.max_new_tokens} before it was "
                f"complete ({raw[-80:]!r}); raise max_tokens."
            )
        tool_chunks: list[dict[str, Any]] = []
        content = raw
        if self.req.tools_active:
            content, calls = parse_tool_calls(raw)
            for i, c in enumerate(calls):
                # A malformed call keeps its raw text, tag included: LangChain's partial-JSON parse of
                # chunk args would otherwise "repair" it into a valid-looking call with missing arguments.
                args = TOOL_OPEN + c.raw if c.error else json.dumps(c.arguments, ensure_ascii=False)
                tool_chunks.append({"name": c.name, "args": args, "id": c.id, "index": i, "type": "tool_call_chunk"})
        tail = content[len(self.shown) :] if content.startswith(self.shown) else ""
        finish = _FINISH.get(chunk.finish_reason or "", chunk.finish_reason)
        if tool_chunks:
            finish = "tool_calls"
        metadata = {
            "model_name": self.model_name,
            "finish_reason": finish,
            "backend_finish_reason": chunk.finish_reason,
            "time_to_first_token": chunk.timings.time_to_first_token,
            "tokens_per_second": chunk.timings.tokens_per_second,
            "model_provider": "exllama",
        }
        if chunk.stop_string is not None:
            metadata["stop_string"] = chunk.stop_string
        usage = UsageMetadata(  # type: ignore[typeddict-item]  # the token details are optional
            input_tokens=chunk.usage.prompt_tokens,
            output_tokens=chunk.usage.completion_tokens,
            total_tokens=chunk.usage.total_tokens,
        )
        msg = AIMessageChunk(
            content=tail,
            usage_metadata=usage,
            response_metadata=metadata,
            tool_call_chunks=tool_chunks,  # type: ignore[arg-type]  # dicts of ToolCallChunk's shape
            chunk_position="last",
        )
        return ChatGenerationChunk(message=msg, generation_info={"finish_reason": finish})


class ChatExLlama(ExLlamaRuntimeMixin, BaseChatModel):
    r"""ExLlama as a LangChain chat model: the model's own chat template, tools, structured output.

    Shares the loaded runtime with every other wrapper on the same model directory.

    Example:
        .. code-block:: python

            from pydantic import BaseModel
            from exllama_integrations.langchain import ChatExLlama

            chat = ChatExLlama(model_dir="/models/Qwen2.5-7B-Instruct-exl3", temperature=0)
            chat.invoke([("system", "Be brief."), ("human", "What is the capital of France?")])

            class City(BaseModel):
                name: str
                country: str

            chat.with_structured_output(City).invoke("Tell me about Paris")  # grammar-constrained JSON

            def add(a: int, b: int) -> int:
                \"\"\"Add two integers.\"\"\"
                return a + b

            msg = chat.bind_tools([add], tool_choice="add").invoke("What is 2 + 3?")
            msg.tool_calls  # [{'name': 'add', 'args': {'a': 2, 'b': 3}, 'id': 'call_...'}]
    """

    timeout: float | None = None
    """Accepted for LangChain's standard parameters; local generation has no network timeout."""
    max_retries: int | None = None
    """Accepted for LangChain's standard parameters; local generation is not retried."""
    streaming: bool = False
    """Stream by default in ``invoke`` (callbacks see tokens either way)."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra variables for the chat template (e.g. ``{"enable_thinking": False}``)."""

    @property
    def _llm_type(self) -> str:
        return "exllama-chat"

    # ----------------------------------------------------------------- token counting

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence[Any] | None = None) -> int:
        """Exact prompt tokens: the messages rendered by the chat template (with the generation prompt)."""
        tool_specs = [convert_to_openai_tool(t) for t in tools] if tools else None
        prompt = self._chat_request(messages, tools=tool_specs).prompt
        return len(self.exllama_runtime.encode(prompt))

    # ----------------------------------------------------------------- request building

    @property
    def _native_tools(self) -> bool:
        return renders_tools(self.exllama_runtime)

    def _chat_request(self, messages: list[BaseMessage], **request: Any) -> ChatRequest:
        """The rendered prompt and constraint for ``messages`` (``request``: build_chat_request's options)."""
        return build_chat_request(
            self.exllama_runtime,
            to_template_messages(messages, native_tools=self._native_tools),
            template_kwargs=self.chat_template_kwargs,
            **request,
        )

    def _request(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> tuple[ChatRequest, GenerationSettings]:
        kwargs = dict(kwargs)
        tools = kwargs.pop("tools", None)
        tool_choice = kwargs.pop("tool_choice", None)
        response_format = kwargs.pop("response_format", None)
        kwargs.pop("ls_structured_output_format", None)
        if kwargs.pop("logprobs", None):
            kwargs["logprobs"] = int(kwargs.pop("top_logprobs", 0) or 0)
        else:
            kwargs.pop("top_logprobs", None)
        settings = self._generate_params(stop, **kwargs)
        # _schema_of: the schema for json_schema, None for json_object (any JSON object)
        schema = _schema_of(response_format) if response_format is not None else None
        chat = self._chat_request(
            messages,
            tools=tools,
            tool_choice=tool_choice,
            json_schema=schema,
            json_object=response_format is not None and schema is None,
        )
        return chat, chat.settings_for(settings)

    # ----------------------------------------------------------------- generation

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        req, settings = self._request(messages, stop, kwargs)
        builder = _ChunkBuilder(req, settings, self.model_name, self.exllama_runtime.tokenizer)
        with self.exllama_runtime.stream(
            req.prompt, settings, constraint=req.constraint, add_special_tokens=False
        ) as stream:
            for rc in stream:
                chunk = builder.feed(rc)
                if chunk is None:
                    continue
                if run_manager is not None:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        req, settings = self._request(messages, stop, kwargs)
        builder = _ChunkBuilder(req, settings, self.model_name, self.exllama_runtime.tokenizer)
        async for rc in self.exllama_runtime.astream(
            req.prompt, settings, constraint=req.constraint, add_special_tokens=False
        ):
            chunk = builder.feed(rc)
            if chunk is None:
                continue
            if run_manager is not None:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return generate_from_stream(self._stream(messages, stop, run_manager, **kwargs))

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return await agenerate_from_stream(self._astream(messages, stop, run_manager, **kwargs))

    # ----------------------------------------------------------------- tools and structured output

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: dict[str, Any] | str | bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools; forced calls are grammar-constrained, so always well-formed JSON for the tool's schema.

        ``tool_choice``: "auto" (model decides), "any"/"required" (must call one), a tool name (must
        call that one), or "none".
        """
        specs = [convert_to_openai_tool(t) for t in tools]
        forced_tools(specs, tool_choice)  # validate the choice now, not at the first call
        return super().bind(tools=specs, tool_choice=tool_choice, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type | None = None,
        *,
        method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | BaseModel]:
        """Outputs shaped like ``schema`` (pydantic class, TypedDict or JSON schema), grammar-constrained.

        ``json_schema`` (default) constrains the reply to the schema; ``function_calling`` forces a call
        to a tool with that schema; ``json_mode`` constrains the reply to a JSON object. ``strict`` is
        accepted: constrained decoding is always strict.
        """
        if kwargs:
            raise InvalidSettingsError(f"unexpected arguments: {', '.join(kwargs)}")
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        if method == "function_calling":
            if schema is None:
                raise InvalidSettingsError("schema must be given for method='function_calling'")
            name = convert_to_openai_tool(schema)["function"]["name"]
            llm = self.bind_tools(
                [schema],
                tool_choice=name,
                ls_structured_output_format={
                    "kwargs": {"method": method, "strict": strict},
                    "schema": convert_to_openai_tool(schema),
                },
            )
            parser: Runnable = (
                PydanticToolsParser(tools=[schema], first_tool_only=True)  # type: ignore[list-item]
                if is_pydantic
                else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
            )
        elif method in ("json_schema", "json_mode"):
            if method == "json_schema" and schema is None:
                raise InvalidSettingsError("schema must be given for method='json_schema'")
            fmt = (
                {"type": "json_object"}
                if method == "json_mode"
                else {"type": "json_schema", "json_schema": {"schema": _json_schema(schema)}}
            )
            ls_format: dict[str, Any] = {
                "kwargs": {"method": method, "strict": strict},
                "schema": _json_schema(schema) if schema is not None else {"type": "object"},
            }
            llm = self.bind(response_format=fmt, ls_structured_output_format=ls_format)
            parser = (
                PydanticOutputParser(pydantic_object=schema)  # type: ignore[arg-type]  # is_pydantic checked
                if is_pydantic
                else JsonOutputParser()
            )
        else:
            raise InvalidSettingsError(f"method must be json_schema, function_calling or json_mode, not {method!r}")
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        none = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([none], exception_key="parsing_error")


def _json_schema(schema: Any) -> dict[str, Any]:
    if isinstance(schema, dict) and ("properties" in schema or "type" in schema or "anyOf" in schema):
        return schema  # already a JSON schema: keep it exactly (converting can drop "required")
    if isinstance(schema, type) and is_basemodel_subclass(schema) and hasattr(schema, "model_json_schema"):
        return schema.model_json_schema()
    return convert_to_json_schema(schema)


def _schema_of(response_format: dict[str, Any]) -> dict[str, Any] | None:
    if not isinstance(response_format, dict):
        raise InvalidSettingsError("response_format must be a dict like {'type': 'json_schema', ...}")
    kind = response_format.get("type")
    if kind == "json_object":
        return None
    if kind == "json_schema":
        js = response_format.get("json_schema") or {}
        schema = js.get("schema", js)
        if not isinstance(schema, dict):
            raise InvalidSettingsError("response_format.json_schema.schema must be a JSON schema object")
        return schema
    raise InvalidSettingsError(f"response_format type must be json_schema or json_object, not {kind!r}")
