"""A server of several models read from its config file (TOML, YAML, JSON alike) or its command line."""

from __future__ import annotations

import json

import pytest

from exllama_integrations.errors import InvalidSettingsError
from exllama_integrations.serve.registry.config import parse_duration, parse_size, read_config

TOML = """
gpu_memory = "20GiB"
ram = "1.5GB"
keep_alive = "1h30m"

[[models]]
name = "chat"
model_dir = "weights/qwen"
backend = "exllamav3"
pinned = true
kind = "chat"
keep_alive = -1
options = { cache_size = 32768, max_seq_len = 8192 }

[[models]]
model_dir = "/models/SmolLM2-135M-Instruct"
keep_alive = 0
ram = "512MiB"
"""

YAML = """
gpu_memory: 20GiB
ram: 1.5GB
keep_alive: 1h30m
models:
  - name: chat
    model_dir: weights/qwen
    backend: exllamav3
    pinned: true
    kind: chat
    keep_alive: -1
    options: {cache_size: 32768, max_seq_len: 8192}
  - model_dir: /models/SmolLM2-135M-Instruct
    keep_alive: 0
    ram: 512MiB
"""


@pytest.mark.parametrize("suffix", [".toml", ".yaml", ".json"])
def test_the_three_formats_say_the_same(tmp_path, suffix):
    (tmp_path / "weights" / "qwen").mkdir(parents=True)
    text = {".toml": TOML, ".yaml": YAML}.get(suffix)
    if text is None:
        import yaml

        text = json.dumps(yaml.safe_load(YAML))
    path = tmp_path / f"serve{suffix}"
    path.write_text(text)
    config = read_config(path)
    assert config.gpu_memory == 20 * 2**30 and config.ram == 1_500_000_000 and config.keep_alive == 5400.0
    chat, smol = config.models
    assert chat.name == "chat" and chat.model_dir == str(tmp_path / "weights" / "qwen")  # relative to the file
    assert chat.backend == "exllamav3" and chat.pinned and chat.keep_alive == -1.0 and chat.kind == "chat"
    assert dict(chat.options) == {"cache_size": 32768, "max_seq_len": 8192}
    assert smol.name == "SmolLM2-135M-Instruct" and smol.keep_alive == 0.0 and smol.ram == 512 * 2**20
    assert not smol.pinned and smol.backend == "auto" and config.names == ["chat", "SmolLM2-135M-Instruct"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[models]]\nmodel_dir = "x"\npined = true\n', "unknown key 'pined' (did you mean 'pinned'?)"),
        ('ramm = "1GiB"\n[[models]]\nmodel_dir = "x"\n', "unknown key 'ramm' (did you mean 'ram'?)"),
        ('[[models]]\nname = "a"\n', "needs model_dir"),
        ('[[models]]\nmodel_dir = "x"\nkind = "vision"\n', "kind must be one of chat, embedding, rerank"),
        ('[[models]]\nmodel_dir = "x"\nkeep_alive = "5 minutes"\n', "keep_alive must be seconds or a duration"),
        ('[[models]]\nmodel_dir = "x"\nram = "lots"\n', "ram must be bytes or a size"),
        ('[[models]]\nmodel_dir = "x"\n[[models]]\nmodel_dir = "y/x"\n', "two models are named 'x'"),
        ("models = []\n", "at least one model"),
        ("models = [\n", "does not parse"),
    ],
)
def test_a_bad_config_is_refused_by_name(tmp_path, text, message):
    path = tmp_path / "serve.toml"
    path.write_text(text)
    with pytest.raises(InvalidSettingsError, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        read_config(path)


def test_sizes_and_durations_as_ollama_and_docker_write_them():
    assert parse_size("16GiB", "x") == parse_size("16G", "x") == 16 * 2**30
    assert parse_size("500MB", "x") == 500_000_000 and parse_size(1024, "x") == 1024
    assert parse_duration("5m", "x") == 300 and parse_duration("1h30m", "x") == 5400
    assert parse_duration("250ms", "x") == 0.25 and parse_duration("-1", "x") == -1 and parse_duration(0, "x") == 0
    assert parse_duration("-5m", "x") == -300
    for bad in ("5 m", "m5", "", "1d"):
        with pytest.raises(InvalidSettingsError):
            parse_duration(bad, "keep_alive")
