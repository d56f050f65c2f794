"""LangChain ``BaseChatModel`` over any ExLlama Runtime: chat templates, tools, structured output (types only).

Everything about chat itself (rendering, tools, grammars, hold-back of tool tags, finish reasons,
metadata) is decided in :mod:`exllama_integrations.runtime.chat`, the same for LlamaIndex and the server.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from operator import itemgetter
from typing import Any, Literal, cast

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.language_models.chat_models import agenerate_from_stream, generate_from_stream
from langchain_core.language_models.model_profile import ModelProfile
from langchain_core.messages import AIMessage, BaseMessage, convert_to_messages
from langchain_core.output_parsers import JsonOutputKeyToolsParser, JsonOutputParser, PydanticToolsParser
from langchain_core.output_parsers.pydantic import PydanticOutputParser
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import (
    Runnable,
    RunnableConfig,
    RunnableLambda,
    RunnableMap,
    RunnablePassthrough,
    RunnableSerializable,
)
from langchain_core.runnables.utils import AnyConfigurableField
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel

from ..chat.outcome import astream_chat, stream_chat
from ..chat.prepare import ChatRequest, PreparedChat, aprepare_chat, forced_tools, prepare_chat
from ..contract.api import Batching, Media, check_depth
from ..errors import InvalidSettingsError
from .messages import lc_chat_chunk, to_template_messages
from .mixin import ExLlamaLangChainMixin, listens_for_tokens

_JSON_SCHEMA_KEYS = ("type", "properties", "$ref", "$defs", "definitions", "anyOf", "oneOf", "allOf", "enum", "const")


class ChatExLlama(ExLlamaLangChainMixin, BaseChatModel):
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

    @property
    def _llm_type(self) -> str:
        return "exllama-chat"

    def _loaded(self) -> None:
        if self.profile is None:  # what the loaded model is and can do (LangChain v1's ModelProfile)
            self.profile = cast("ModelProfile", self._profile())

    def configurable_fields(self, **kwargs: AnyConfigurableField) -> RunnableSerializable[LanguageModelInput, Any]:
        """LangChain's ``configurable_fields``, by any name the constructor takes (``max_tokens``, ``num_predict``).

        Raises:
            InvalidSettingsError: a name that sets no field, with the name to use.
        """
        return super().configurable_fields(**{self.configurable_name(k): v for k, v in kwargs.items()})

    # ----------------------------------------------------------------- requests

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence[Any] | None = None) -> int:
        """Exact prompt tokens: the messages rendered by the chat template (with the generation prompt)."""
        tool_specs = [convert_to_openai_tool(t) for t in tools] if tools else ()
        request = self._chat_request(convert_to_messages(messages), None, {"tools": tool_specs})
        prepared = prepare_chat(self._runtime, request).request
        exact = getattr(self._runtime, "prompt_token_ids", None)  # in process: images counted as the model reads them
        if exact is not None:
            return len(exact(prepared))
        prompt = prepared.prompt
        return len(prompt) if isinstance(prompt, tuple) else len(self._runtime.encode(prompt))

    def _chat_request(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]) -> ChatRequest:
        """The chat call as a plain value: messages, bound tools and formats, template variables, settings."""
        kwargs = dict(kwargs)
        bound = {k: kwargs.pop(k, None) for k in ("tools", "tool_choice", "response_format", "parallel_tool_calls")}
        kwargs.pop("ls_structured_output_format", None)
        template_kwargs = self._template_kwargs(kwargs.pop("chat_template_kwargs", None))
        media: list[Media] = []
        return ChatRequest(
            messages=to_template_messages(messages, media),
            settings=self._settings(stop, kwargs),
            tools=bound.get("tools") or (),
            tool_choice=bound.get("tool_choice"),
            response_format=bound.get("response_format"),
            template_kwargs=template_kwargs,
            chat_template=self.chat_template,
            split_special_tokens=self.split_special_tokens,
            reasoning_tags=self.reasoning_tags,
            media=media,
            tool_format=self.tool_format,
            parallel_tool_calls=bound.get("parallel_tool_calls"),
        )

    def _prepare(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]) -> PreparedChat:
        return prepare_chat(self._runtime, self._chat_request(messages, stop, kwargs))

    # ----------------------------------------------------------------- generation

    def batch(
        self,
        inputs: list[LanguageModelInput],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[AIMessage]:  # type: ignore[override]
        """LangChain's ``batch``, run as :meth:`abatch` on one event loop, so every input reaches the backend at once.

        LangChain's default ``batch`` gives each input a thread from a pool of ``min(32, CPUs + 4)``: a batch
        runs in waves on small machines, and on a GPU the threads reach the backend one by one, while its
        driver holds the GIL, so their jobs start over several steps instead of prefilling together. Callbacks,
        ``max_concurrency`` and ``return_exceptions`` behave as in LangChain's ``abatch``.
        """
        if not inputs:
            return []
        ctx = contextvars.copy_context()  # tracing and callback context, as the caller's thread has it

        def run() -> list[Any]:
            return asyncio.run(self.abatch(inputs, config, return_exceptions=return_exceptions, **kwargs))

        with ThreadPoolExecutor(1, thread_name_prefix="exllama-chat-batch") as pool:  # works under a running loop too
            return pool.submit(ctx.run, run).result()  # type: ignore[no-any-return]

    async def abatch(
        self,
        inputs: list[LanguageModelInput],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[AIMessage]:  # type: ignore[override]
        """LangChain's ``abatch``; the runtime is told how many calls are coming, so they prefill together."""
        configs = config if isinstance(config, list) else [config or {}]
        limits = [int(c.get("max_concurrency") or 0) for c in configs if c]
        limits = [m for m in limits if m > 0]
        if isinstance(self._runtime, Batching):
            self._runtime.expect(min([len(inputs), *limits]))
        return await super().abatch(inputs, config, return_exceptions=return_exceptions, **kwargs)  # type: ignore[return-value]

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        yield from self._chunks(messages, stop, run_manager, True, kwargs)

    def _chunks(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        run_manager: CallbackManagerForLLMRun | None,
        incremental: bool,
        kwargs: dict[str, Any],
    ) -> Iterator[ChatGenerationChunk]:
        prepared = self._prepare(messages, stop, kwargs)
        wants_logprobs = prepared.request.settings.logprobs is not None
        for item in stream_chat(self._runtime, prepared, incremental=incremental):
            chunk = lc_chat_chunk(item, wants_logprobs)
            if run_manager is not None and incremental:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        async for chunk in self._achunks(messages, stop, run_manager, True, kwargs):
            yield chunk

    async def _achunks(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        run_manager: AsyncCallbackManagerForLLMRun | None,
        incremental: bool,
        kwargs: dict[str, Any],
    ) -> AsyncIterator[ChatGenerationChunk]:
        prepared = await aprepare_chat(self._runtime, self._chat_request(messages, stop, kwargs))
        wants_logprobs = prepared.request.settings.logprobs is not None
        async for item in astream_chat(self._runtime, prepared, incremental=incremental):
            chunk = lc_chat_chunk(item, wants_logprobs)
            if run_manager is not None and incremental:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        # LangChain calls _stream itself for streaming=True and for streaming tracers; here the tokens go to
        # whichever handler listens for them, and with none the whole reply is read at once
        listening = listens_for_tokens(run_manager)
        return generate_from_stream(self._chunks(messages, stop, run_manager, listening, kwargs))

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        listening = listens_for_tokens(run_manager)
        return await agenerate_from_stream(self._achunks(messages, stop, run_manager, listening, kwargs))

    # ----------------------------------------------------------------- tools and structured output

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: dict[str, Any] | str | bool | None = None,
        parallel_tool_calls: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools; calls are read in the model family's own format, and forced calls are grammar-constrained.

        ``tool_choice``: "auto" (model decides), "any"/"required" (must call one), a tool name (must
        call that one), or "none". ``parallel_tool_calls=False``: at most one call a reply.
        """
        specs = [convert_to_openai_tool(t) for t in tools]
        forced_tools(specs, tool_choice)  # validate the choice now, not at the first call
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
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
        to a tool with that schema; ``json_mode`` constrains the reply to a JSON object, and to ``schema``
        when one is given (OpenAI's json_mode only asks for JSON; nothing is lost by holding the reply to
        the schema the parser will read it with). ``strict`` is accepted: constrained decoding is always strict.
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
                if schema is None
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
        # Parse the whole reply once: LangChain's parsers would stream partial objects whose missing strings read
        # as real values (City(name='')); a grammar-constrained reply is complete only at its end.
        parser = RunnableLambda(parser.invoke, afunc=parser.ainvoke, name=type(parser).__name__)
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        none = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([none], exception_key="parsing_error")


def _json_schema(schema: Any) -> dict[str, Any]:
    if isinstance(schema, dict):
        check_depth(schema)  # before LangChain's own converters recurse out of stack on it
    if isinstance(schema, dict) and any(k in schema for k in _JSON_SCHEMA_KEYS):
        return schema  # already a JSON schema (top-level $ref, oneOf, enum included): keep it exactly
    if isinstance(schema, type) and is_basemodel_subclass(schema) and hasattr(schema, "model_json_schema"):
        return schema.model_json_schema()
    try:
        return convert_to_json_schema(schema)
    except (ValueError, TypeError) as e:
        raise InvalidSettingsError(
            f"cannot turn {schema!r} into a JSON schema ({e}); pass a pydantic class, a TypedDict or a JSON schema."
        ) from None
