"""LangChain's standard chat-model suites, on the real demo model through the CPU backend.

Tests the 135M model cannot pass for reasons of model quality are xfailed in tests/conftest.py,
each with the reason and what the model does.
"""

from __future__ import annotations

from langchain_core.messages import AIMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from exllama_integrations.langchain import ChatExLlama


class _ChatExLlamaSuite:
    @property
    def chat_model_class(self) -> type[ChatExLlama]:
        return ChatExLlama

    @property
    def chat_model_params(self) -> dict:
        from exllama_integrations.demo_model import demo_model_dir

        return {"model_dir": str(demo_model_dir()), "backend": "transformers", "temperature": 0}

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
        from servers import demo_server

        return {"base_url": demo_server(), "temperature": 0, "max_tokens": 100}


class TestChatExLlamaIntegrationLlama3Tools(TestChatExLlamaIntegration):
    """The standard suite's tool-calling tests for a model whose format is not Hermes: the demo model's weights
    with a Llama 3.1-shaped template (tools in the first user turn, calls written as bare JSON with
    ``"parameters"``, results in the ``ipython`` role), so forced calls are written and read in Llama 3's syntax.
    Only the tool tests run (``tests/conftest.py`` keeps those of this class)."""

    @property
    def chat_model_params(self) -> dict:
        from tool_families import FAMILIES

        return {**super().chat_model_params, "chat_template": FAMILIES["llama3"].template}
