"""Public classes carry a usage example; docstring examples that can run, run; pydoc renders every module."""

import doctest
import importlib
import pydoc

import pytest

PUBLIC_CLASSES = [
    ("exllama_integrations", "ExLlamaRuntime"),
    ("exllama_integrations", "GenerationSettings"),
    ("exllama_integrations.langchain", "ExLlamaLLM"),
    ("exllama_integrations.langchain", "ChatExLlama"),
    ("exllama_integrations.llama_index", "ExLlamaLLM"),
    ("exllama_integrations.runtime", "NativeTokenizer"),
    ("exllama_integrations.runtime", "IncrementalDetokenizer"),
    ("exllama_integrations.runtime", "StopStringMatcher"),
    ("exllama_integrations.runtime.constraints", "TokenConstraint"),
]
MODULES = [
    "exllama_integrations",
    "exllama_integrations.runtime",
    "exllama_integrations.runtime.runtime",
    "exllama_integrations.runtime.settings",
    "exllama_integrations.runtime.streaming",
    "exllama_integrations.runtime.tokenizer",
    "exllama_integrations.runtime.constraints",
    "exllama_integrations.runtime.chat",
    "exllama_integrations.runtime.model_dir",
    "exllama_integrations.errors",
    "exllama_integrations.langchain",
    "exllama_integrations.llama_index",
    "exllama_integrations.demo_model",
    "exllama_integrations.runtime.backends.exllamav3",
    "exllama_integrations.runtime.backends.exllama",
    "exllama_integrations.runtime.backends.exllamav2",
    "exllama_integrations.runtime.backends.transformers",
]


@pytest.mark.parametrize(("module", "name"), PUBLIC_CLASSES)
def test_public_class_has_an_example(module: str, name: str) -> None:
    doc = getattr(importlib.import_module(module), name).__doc__ or ""
    assert "Example" in doc and (">>>" in doc or "code-block" in doc)


@pytest.mark.parametrize("module", ["exllama_integrations.runtime.streaming", "exllama_integrations.runtime.settings"])
def test_docstring_examples_run(module: str) -> None:
    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("module", MODULES)
def test_pydoc_renders(module: str) -> None:
    text = pydoc.render_doc(importlib.import_module(module), renderer=pydoc.plaintext)
    assert module.split(".")[-1] in text
