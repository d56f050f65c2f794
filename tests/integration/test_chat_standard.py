"""LangChain's standard chat-model suites through the CPU backend.

The suites check plumbing (invoke, stream, batch, usage, stop, messages of every kind, tool messages), which runs on
SmolLM2's tokenizer over a tiny random model (tests/fixture_models.py), ~20x faster; the tests in TRAINED, where the
model must write a forced tool call's string argument to its end, run on the real demo model (a random model never
closes the string). Tests the 135M model cannot pass for reasons of model quality are xfailed in tests/conftest.py,
each with the reason and what the model does.
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.messages import AIMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from exllama_integrations.langchain import ChatExLlama

TRAINED = {
    "test_tool_calling",
    "test_tool_calling_async",
    "test_bind_runnables_as_tools",
    "test_unicode_tool_call_integration",
    "test_tool_calling_with_no_arguments",
}
"""Standard tests whose forced tool call a random model cannot finish (it never closes a string argument, or writes
Llama 3's call to no end): they get the real demo model (``trained_params``)."""


class _ChatExLlamaSuite:
    @property
    def chat_model_class(self) -> type[ChatExLlama]:
        return ChatExLlama

    @property
    def chat_model_params(self) -> dict:
        from fixture_models import tiny_smollm2_dir

        return {"model_dir": str(tiny_smollm2_dir()), "backend": "transformers", "temperature": 0}

    @property
    def trained_params(self) -> dict:
        """``chat_model_params`` on the real demo model, for the tests in TRAINED."""
        from exllama_integrations.demo_model import demo_model_dir

        return {**self.chat_model_params, "model_dir": str(demo_model_dir())}

    @pytest.fixture
    def model(self, request: Any) -> ChatExLlama:
        """The standard suites' ``model`` fixture, on the demo model for the tests in TRAINED."""
        trained = request.node.originalname in TRAINED
        params = self.trained_params if trained else self.chat_model_params
        extra = getattr(request, "param", None) or {}
        return self.chat_model_class(**{**self.standard_chat_model_params, **params, **extra})

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def returns_usage_metadata(self) -> bool:
        return True


class TestChatExLlamaUnit(_ChatExLlamaSuite, ChatModelUnitTests):
    @property
    def init_from_env_params(self) -> tuple[dict, dict, dict]:
        return {}, {}, {}


class TestChatExLlamaIntegration(_ChatExLlamaSuite, ChatModelIntegrationTests):
    @property
    def chat_model_params(self) -> dict:
        return {**super().chat_model_params, "max_tokens": 100}  # keeps the xfailed loops short

    @property
    def supported_usage_metadata_details(self) -> dict:
        both = ["reasoning_output", "cache_read_input"]
        return {"invoke": both, "stream": both}

    def _reply(self, model: ChatExLlama, text: str, stream: bool) -> AIMessage:
        if not stream:
            return model.invoke(text)
        chunks = list(model.stream(text))
        full = chunks[0]
        for c in chunks[1:]:
            full = full + c
        return full  # type: ignore[return-value]

    def invoke_with_reasoning_output(self, *, stream: bool = False) -> AIMessage:
        from helpers import THINKS

        params = {**self.chat_model_params, "chat_template": THINKS, "max_reasoning_tokens": 8}
        msg = self._reply(self.chat_model_class(**params), "What is the capital of France?", stream)
        assert msg.usage_metadata["output_token_details"]["reasoning"] >= 8  # thought, up to the budget
        return msg

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        return self._reply(self.chat_model_class(**self.chat_model_params), "What is 2 + 2?", stream)


class TestChatExLlamaIntegrationServed(TestChatExLlamaIntegration):
    """The same standard suite, with the model on a real server (base_url=)."""

    @property
    def chat_model_params(self) -> dict:
        from servers import shared_server

        from fixture_models import tiny_smollm2_dir

        return {"base_url": shared_server(tiny_smollm2_dir()), "temperature": 0, "max_tokens": 100}

    @property
    def trained_params(self) -> dict:
        from servers import demo_server

        return {**self.chat_model_params, "base_url": demo_server()}


class TestChatExLlamaIntegrationLlama3Tools(TestChatExLlamaIntegration):
    """The standard suite's tool-calling tests for a model whose format is not Hermes: SmolLM2's
    tokenizer with a Llama 3.1-shaped template (tools in the first user turn, calls written as bare JSON with
    ``"parameters"``, results in the ``ipython`` role), so forced calls are written and read in Llama 3's syntax.
    Only the tool tests run (``tests/conftest.py`` keeps those of this class)."""

    @property
    def chat_model_params(self) -> dict:
        from tool_families import FAMILIES

        return {**super().chat_model_params, "chat_template": FAMILIES["llama3"].template}
