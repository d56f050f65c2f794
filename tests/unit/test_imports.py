import subprocess
import sys

import pytest

import exllama_integrations


def test_public_api_is_pinned():
    assert sorted(exllama_integrations.__all__) == sorted(
        [
            "BackendUnavailableError",
            "ChatTemplateError",
            "ConstraintError",
            "ConstraintViolationError",
            "ContextLengthError",
            "DecisionRequest",
            "DecisionResult",
            "EmbeddingRequest",
            "EmbeddingResult",
            "EmbeddingRuntime",
            "ExLlamaIntegrationsError",
            "ExLlamaRuntime",
            "EngineUnavailableError",
            "GenerationError",
            "GenerationRequest",
            "GenerationResult",
            "GenerationSettings",
            "Grammar",
            "InputTooLongError",
            "InvalidModelError",
            "InvalidSettingsError",
            "Media",
            "MediaError",
            "MissingDependencyError",
            "ModelInfo",
            "ModelLoadError",
            "ModelNotFoundError",
            "ModelUnavailableError",
            "ProtocolError",
            "Reasoning",
            "RemoteRuntime",
            "RerankRequest",
            "RerankResult",
            "Runtime",
            "RuntimeClosedError",
            "ServerBusyError",
            "ServerError",
            "StreamChunk",
            "UnsupportedModelError",
            "UnsupportedTaskError",
            "__version__",
        ]
    )


def test_the_langchain_classes_are_pinned():
    import exllama_integrations.langchain as lc

    assert sorted(lc.__all__) == ["ChatExLlama", "ExLlamaDecisions", "ExLlamaEmbeddings", "ExLlamaLLM", "ExLlamaRerank"]


def test_import_is_light():
    """Importing the package (and its LangChain-free runtime) pulls in no torch, framework or backend."""
    code = (
        "import sys, exllama_integrations, exllama_integrations.runtime;"
        "heavy = [m for m in ('torch', 'transformers', 'langchain_core', 'llama_index', 'exllamav3', 'exllama',"
        " 'exllamav2', 'llguidance', 'fastapi', 'uvicorn', 'httpx', 'ray', 'zmq') if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_old_chunk_name_still_works_with_a_warning():
    from exllama_integrations import StreamChunk

    with pytest.warns(DeprecationWarning, match="StreamChunk"):
        from exllama_integrations import GenerationChunk
    assert GenerationChunk is StreamChunk


def test_adapters_import_no_concrete_runtime_at_module_level():
    """Adapters speak the contract: they name the in-process runtime only where they build one from model_dir."""
    import ast
    from pathlib import Path

    root = Path(exllama_integrations.__file__).parent
    for path in [root / "_adapter.py", *root.glob("langchain/*.py"), *root.glob("llama_index/*.py")]:
        tree = ast.parse(path.read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = {a.name for n in top for a in n.names} | {getattr(n, "module", "") or "" for n in top}
        assert not any("local" in n or n == "ExLlamaRuntime" for n in names), path.name


def test_missing_extra_names_the_extra(monkeypatch):
    from exllama_integrations import MissingDependencyError
    from exllama_integrations.backends.base import require

    try:
        require("definitely_not_installed_pkg", "exllamav3", "testing")
    except MissingDependencyError as e:
        assert "exllama-integrations[exllamav3]" in str(e)
        assert isinstance(e, ImportError)
    else:
        raise AssertionError("expected MissingDependencyError")


@pytest.mark.parametrize(
    ("module", "blocked", "extra"),
    [
        ("exllama_integrations.serve.app", "fastapi", "serve"),
        ("exllama_integrations.runtime.remote", "httpx", "remote"),
    ],
)
def test_a_missing_serving_extra_is_named(module, blocked, extra):
    code = f"import sys; sys.modules[{blocked!r}] = None; import {module}"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0 and f"exllama-integrations[{extra}]" in out.stderr
