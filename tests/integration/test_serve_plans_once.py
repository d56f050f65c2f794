"""``serve`` plans each model once: its directory inspected once in the server's process, the plan loaded as it is.

One model (``serve DIR``) and several (``serve DIR DIR``) are run through the CLI as a user runs them, with uvicorn
replaced by a recorder of the app it would serve; the app then answers real requests on the demo models (the chat
model in this process, ``--engine thread``, or in an engine process of its own; the embedding model in this process).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from exllama_integrations import cli
from exllama_integrations.model.directory import ModelDirectory
from exllama_integrations.serve import launch

pytestmark = pytest.mark.slow


@pytest.fixture
def inspected(monkeypatch):
    """Each directory this process inspects, counted by name."""
    seen: Counter[str] = Counter()
    original = ModelDirectory.inspect.__func__

    def counting(cls, path, *args, **kwargs):
        seen[Path(path).name] += 1
        return original(cls, path, *args, **kwargs)

    monkeypatch.setattr(ModelDirectory, "inspect", classmethod(counting))
    return seen


@pytest.fixture
def served(monkeypatch):
    """The app ``serve`` would run on uvicorn (uvicorn is not started)."""
    apps: list = []
    monkeypatch.setattr(launch, "run_http", lambda app, args: apps.append(app) or 0)
    return apps


def test_one_model_is_planned_once_and_served_from_its_plan(demo_dir, inspected, served):
    argv = ["serve", str(demo_dir), "--backend", "transformers", "--engine", "thread", "--max-seq-len", "512"]
    assert cli.main(argv) == 0
    assert inspected == {demo_dir.name: 1}  # 3 before: its task, a server's options, the runtime's own load
    (app,) = served
    with TestClient(app) as client:
        card = client.get("/v1/models").json()["data"][0]
        assert card["id"] == demo_dir.name and card["max_model_len"] == 512  # the plan's options, as given
        body = {"model": demo_dir.name, "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert app.state.runtime.closed  # closed as the app stops


def test_several_models_are_each_planned_once_and_loaded_from_their_plans(demo_dir, minilm_dir, inspected, served):
    argv = ["serve", str(demo_dir), str(minilm_dir), "--backend", "transformers"]
    assert cli.main(argv) == 0
    assert inspected == {demo_dir.name: 1, minilm_dir.name: 1}  # planned as the server starts, kinds found
    (app,) = served
    with TestClient(app) as client:
        r = client.post("/v1/embeddings", json={"model": minilm_dir.name, "input": ["a cat", "a dog"]})
        assert r.status_code == 200 and len(r.json()["data"]) == 2
        body = {"model": demo_dir.name, "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}
        r = client.post("/v1/completions", json=body)  # loaded in an engine process of its own, from its plan
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        cards = {c["id"]: c for c in client.get("/v1/models").json()["data"]}
        assert cards[demo_dir.name]["kind"] == "chat" and cards[minilm_dir.name]["kind"] == "embedding"
    assert inspected == {demo_dir.name: 1, minilm_dir.name: 1}  # 4 and 3 before: loads inspected them again
