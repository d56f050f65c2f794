import subprocess
import sys

import exllama_integrations


def test_public_api_is_pinned():
    assert sorted(exllama_integrations.__all__) == sorted(
        [
            "BackendUnavailableError",
            "ConstraintError",
            "ConstraintViolationError",
            "ContextLengthError",
            "ExLlamaIntegrationsError",
            "ExLlamaRuntime",
            "GenerationChunk",
            "GenerationResult",
            "GenerationSettings",
            "InvalidModelError",
            "InvalidSettingsError",
            "MissingDependencyError",
            "ModelLoadError",
            "ModelNotFoundError",
            "RuntimeClosedError",
            "UnsupportedModelError",
            "__version__",
        ]
    )


def test_import_is_light():
    """Importing the package (and its LangChain-free runtime) pulls in no torch, framework or backend."""
    code = (
        "import sys, exllama_integrations, exllama_integrations.runtime;"
        "heavy = [m for m in ('torch', 'transformers', 'langchain_core', 'llama_index', 'exllamav3', 'exllama',"
        " 'exllamav2', 'llguidance') if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_missing_extra_names_the_extra(monkeypatch):
    from exllama_integrations import MissingDependencyError
    from exllama_integrations.runtime.backends.base import require

    try:
        require("definitely_not_installed_pkg", "exllamav3", "testing")
    except MissingDependencyError as e:
        assert "exllama-integrations[exllamav3]" in str(e)
        assert isinstance(e, ImportError)
    else:
        raise AssertionError("expected MissingDependencyError")
