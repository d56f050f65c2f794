"""Public classes carry a usage example; docstring examples that can run, run; pydoc renders every module."""

import doctest
import importlib
import pkgutil
import pydoc

import pytest

import exllama_integrations

PUBLIC_CLASSES = [
    ("exllama_integrations", "ExLlamaRuntime"),
    ("exllama_integrations", "GenerationSettings"),
    ("exllama_integrations", "Grammar"),
    ("exllama_integrations.model.template", "ChatTemplate"),
    ("exllama_integrations.langchain", "ExLlamaLLM"),
    ("exllama_integrations.langchain", "ChatExLlama"),
    ("exllama_integrations.llama_index", "ExLlamaLLM"),
    ("exllama_integrations.model.tokenizer", "NativeTokenizer"),
    ("exllama_integrations.model.detokenizer", "IncrementalDetokenizer"),
    ("exllama_integrations.model.detokenizer", "StopStringMatcher"),
    ("exllama_integrations", "GenerationRequest"),
    ("exllama_integrations.runtime.remote", "RemoteRuntime"),
    ("exllama_integrations.model.grammar", "TokenConstraint"),
    ("exllama_integrations", "EmbeddingRuntime"),
    ("exllama_integrations.langchain", "ExLlamaEmbeddings"),
    ("exllama_integrations.langchain", "ExLlamaRerank"),
    ("exllama_integrations.llama_index", "ExLlamaEmbedding"),
    ("exllama_integrations.llama_index", "ExLlamaRerank"),
]
MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(exllama_integrations.__path__, "exllama_integrations.")
    if not m.name.endswith("__main__")
)


@pytest.mark.parametrize(("module", "name"), PUBLIC_CLASSES)
def test_public_class_has_an_example(module: str, name: str) -> None:
    doc = getattr(importlib.import_module(module), name).__doc__ or ""
    assert "Example" in doc and (">>>" in doc or "code-block" in doc)


@pytest.mark.parametrize(
    "module",
    [
        "exllama_integrations.model.detokenizer",
        "exllama_integrations.contract.settings",
        "exllama_integrations.contract.api",
        "exllama_integrations.contract.wire",
        "exllama_integrations.contract.retrieval",
        "exllama_integrations.model.template",
        "exllama_integrations.model.media",
        "exllama_integrations.chat.content",
    ],
)
def test_docstring_examples_run(module: str) -> None:
    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("module", MODULES)
def test_pydoc_renders(module: str) -> None:
    text = pydoc.render_doc(importlib.import_module(module), renderer=pydoc.plaintext)
    assert module.split(".")[-1] in text


@pytest.mark.parametrize("module", MODULES)
def test_every_module_says_its_job(module: str) -> None:
    doc = importlib.import_module(module).__doc__ or ""
    assert len(doc.strip()) > 20, f"{module} has no opening docstring"


def test_the_readme_names_only_real_backend_options() -> None:
    """Each option docs/configuration.md's table lists for a backend is a field of that backend's options."""
    import re
    from pathlib import Path

    from exllama_integrations.backends.exllama import ExLlamaV1Options
    from exllama_integrations.backends.exllamav3.options import ExLlamaV3Options
    from exllama_integrations.backends.transformers import TransformersOptions

    page = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()  # the README links it
    row = next(line for line in page.splitlines() if line.startswith("| `backend_options` |"))
    classes = {"exllamav3": ExLlamaV3Options, "transformers": TransformersOptions, "exllama v1": ExLlamaV1Options}
    seen = 0
    for part in row.split("|")[2].split(";"):
        label, _, names = part.partition(":")
        cls = classes[label.strip()]
        for name in re.findall(r"`(\w+)`", names):
            assert name in cls.model_fields, f"docs lists {name!r} for {label.strip()}: no such option"
            seen += 1
    assert seen >= 15
