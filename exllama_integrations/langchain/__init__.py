"""LangChain integrations: ``ExLlamaLLM`` (BaseLLM) and ``ChatExLlama`` (BaseChatModel)."""

try:
    import langchain_core  # noqa: F401
except ImportError:  # pragma: no cover - exercised by the missing-extra test
    from ..errors import MissingDependencyError

    raise MissingDependencyError("langchain-core", "langchain", "the LangChain classes") from None

from .chat_models import ChatExLlama
from .llms import ExLlamaLLM

__all__ = ["ChatExLlama", "ExLlamaLLM"]
