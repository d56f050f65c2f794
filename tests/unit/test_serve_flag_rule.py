"""``serve`` refuses a flag its serving mode does not read (exit 2, naming the flag) instead of ignoring it.

The modes: one model (``serve DIR``), several directories, a config file, each with or without ``--ray``. The
command is run through the CLI as a user runs it, with uvicorn and Ray's start replaced by recorders: a refused
command starts neither and loads nothing (the directories here do not exist: a refusal comes before any is read).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from exllama_integrations import cli
from exllama_integrations.serve import launch
from exllama_integrations.serve.ray import deployment

ONE = ["/models/one"]
SEVERAL = ["/models/one", "/models/two"]


@pytest.fixture
def started(monkeypatch, tmp_path):
    """What ``serve`` started: uvicorn apps and Ray apps (neither really started)."""
    runs: list = []
    monkeypatch.setattr(launch, "run_http", lambda app, args: runs.append(app) or 0)
    monkeypatch.setattr(deployment, "_run", lambda app_args, host, port, what: runs.append(app_args) or 0)
    return runs


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text('[[models]]\nmodel_dir = "/models/one"\n')
    return str(path)


REFUSED = [
    # a config file: each model's entry sets its own load options
    ("config", ["--draft", "mtp"], "--draft", "--config"),
    ("config", ["--option", "cache_size=4096"], "--option", "--config"),
    ("config", ["--max-seq-len", "512"], "--max-seq-len", "--config"),
    ("config", ["--served-model-name", "x"], "--served-model-name", "--config"),
    ("config", ["--backend", "transformers"], "--backend", "--config"),
    ("config", ["--dtype", "float32"], "--dtype", "--config"),
    ("config", ["--tool-format", "hermes"], "--tool-format", "--config"),
    # several directories: one model's flags
    ("several", ["--tool-format", "no-such-format"], "--tool-format", "several model directories"),
    ("several", ["--tool-format", "hermes"], "--tool-format", "several model directories"),
    ("several", ["--served-model-name", "x"], "--served-model-name", "several model directories"),
    ("several", ["--chat-template", "{{ messages }}"], "--chat-template", "several model directories"),
    ("several", ["--engines", "2"], "--engines", "several model directories"),
    ("several", ["--kind", "embedding"], "--kind", "several model directories"),
    ("several", ["--task", "embed"], "--task", "several model directories"),
    ("several", ["--engine", "thread"], "--engine", "several model directories"),
    # one model: the budget of several
    ("one", ["--keep-alive", "garbage"], "--keep-alive", "one model"),
    ("one", ["--ram", "garbage"], "--ram", "one model"),
    ("one", ["--gpu-memory", "garbage"], "--gpu-memory", "one model"),
    ("one", ["--keep-alive", "5m"], "--keep-alive", "one model"),
    # Ray's flags without --ray, and what Ray's deployments do not read
    ("one", ["--replicas", "2"], "--replicas", "without --ray"),
    ("several", ["--num-gpus", "0"], "--num-gpus", "without --ray"),
    ("ray one", ["--engines", "2"], "--engines", "--ray"),
    ("ray one", ["--kind", "embedding"], "--kind", "--ray"),
    ("ray one", ["--task", "embed"], "--task", "--ray"),
    ("ray several", ["--keep-alive", "5m"], "--keep-alive", "--ray"),
]


def _models(mode: str, config: str) -> list[str]:
    ray = ["--ray"] if mode.startswith("ray") else []
    if mode.endswith("config"):
        return [*ray, "--config", config]
    return [*ray, *(SEVERAL if mode.endswith("several") else ONE)]


@pytest.mark.parametrize(("mode", "flags", "named", "where"), REFUSED, ids=[" ".join(r[1]) for r in REFUSED])
def test_a_flag_the_mode_does_not_read_is_refused_naming_it(started, capsys, config, mode, flags, named, where):
    assert cli.main(["serve", *_models(mode, config), *flags]) == 2
    assert started == []  # nothing served, nothing loaded
    err = capsys.readouterr().err
    assert f"InvalidSettingsError: {named} is not read with {where}:" in err


@pytest.mark.parametrize(
    ("mode", "flags"),
    [
        ("ray one", ["--served-model-name", "x", "--tool-format", "hermes", "--max-seq-len", "512"]),
        ("ray several", ["--option", "cache_size=4096", "--draft", "mtp", "--replicas", "2"]),
        ("ray config", ["--num-gpus", "0.5"]),
    ],
)
def test_the_flags_a_mode_reads_are_taken(started, config, mode, flags):
    """Ray's modes take the flags they read (their effect is asserted in test_serve_ray_flags and test_ray_serve)."""
    assert cli.main(["serve", *_models(mode, config), *flags]) == 0
    (app,) = started
    if mode == "ray one":
        assert (app["served_model_name"], app["tool_format"], app["runtime"]["max_seq_len"]) == ("x", "hermes", 512)
    elif mode == "ray several":
        assert [m["runtime"] for m in app["models"]] == [{"cache_size": 4096, "draft": "mtp"}] * 2
        assert [m["num_replicas"] for m in app["models"]] == [2, 2]
        deployment.build_app(app)  # a deployment each: a kind found on the nodes is a chat model's, not refused
    else:
        assert app["num_gpus"] == 0.5


def test_serve_ray_without_the_ray_extra_names_the_install_command():
    """Without Ray installed, ``serve --ray`` says what to install (from a clone) and exits 2, with no traceback."""
    code = (
        "import sys; sys.modules['ray'] = None\n"  # as if the extra were not installed
        "from exllama_integrations.cli import main\n"
        "sys.exit(main(['serve', '--ray', '/models/one']))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "MissingDependencyError" in done.stderr and 'pip install -e ".[ray]"' in done.stderr


@pytest.mark.parametrize("flag", [["--engines", "2"], ["--engine", "thread"]])
def test_an_embedding_model_served_alone_refuses_the_engine_flags(started, capsys, minilm_dir, flag):
    """An embedding model runs in the server's process: the engine flags, read only for a chat model, are refused
    once its files say what it is (before it loads)."""
    assert cli.main(["serve", str(minilm_dir), "--backend", "transformers", *flag]) == 2
    assert started == []
    assert f"InvalidSettingsError: {flag[0]} is not read with one embedding model:" in capsys.readouterr().err


def test_kind_says_what_a_model_served_alone_is_and_task_is_its_old_name(started, monkeypatch, capsys):
    """``--kind`` is the one word for what a model is (as a config file's entries and ``EmbeddingRuntime(kind=)``
    say it); ``--task``, its old name, still works and warns with what to write; both together are refused."""
    seen: list = []
    real = launch.models_of
    monkeypatch.setattr(launch, "models_of", lambda args: seen.append(real(args)) or seen[-1])
    cli.main(["serve", *ONE, "--kind", "rerank"])  # the directory does not exist: what matters is what was planned
    assert [m.kind for m in seen[-1].models] == ["rerank"]
    with pytest.warns(FutureWarning, match="serve --task embed is deprecated: write --kind embedding"):
        cli.main(["serve", *ONE, "--task", "embed"])
    assert [m.kind for m in seen[-1].models] == ["embedding"]
    capsys.readouterr()
    assert cli.main(["serve", *ONE, "--kind", "chat", "--task", "embed"]) == 2
    assert "give --kind alone (--task is its old name)" in capsys.readouterr().err
