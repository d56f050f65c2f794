"""A server of one model is a registry of one: the same front, routes and answers as a server of several.

``serve DIR`` and ``serve DIR DIR`` run through the CLI as a user runs them, uvicorn replaced by a recorder of the app
it would serve; ``create_app(runtime)`` (a runtime loaded in this process) builds the same front over a registry of
that runtime. What a server of one model and one of several used to answer differently they now answer alike: a wrong
method, a model of the wrong kind, a body that is not JSON, ``/health``.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from exllama_integrations import cli
from exllama_integrations.serve import launch
from exllama_integrations.serve.app import create_app
from exllama_integrations.serve.registry.models import ModelRegistry

pytestmark = pytest.mark.slow


@pytest.fixture
def served(monkeypatch):
    """The apps ``serve`` would run on uvicorn (uvicorn is not started)."""
    apps: list = []
    monkeypatch.setattr(launch, "run_http", lambda app, args: apps.append(app) or 0)
    return apps


def routes(app) -> list[tuple[str, tuple[str, ...]]]:
    """The app's route table: each path with its methods."""
    return sorted((r.path, tuple(sorted(getattr(r, "methods", None) or ()))) for r in app.routes)


def answers(app, model: str) -> dict[str, tuple[int, str]]:
    """What the app answers (status, code) to what a server of one model and one of several used to answer apart."""
    with TestClient(app) as client:
        chat = client.post(
            "/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "hi"}]}
        )
        wrong_method = client.get("/v1/completions")
        not_json = client.post("/v1/embeddings", content=b"{not json", headers={"content-type": "application/json"})
        health = client.get("/health")
    return {
        "chat to an embedding model": (chat.status_code, chat.json()["error"]["code"], chat.json()["error"]["message"]),
        "GET /v1/completions": (wrong_method.status_code, wrong_method.json()["error"]["code"]),
        "a body that is not JSON": (not_json.status_code, not_json.json()["error"]["code"]),
        "/health": (health.status_code, tuple(sorted(health.json()))),
    }


def test_one_model_and_several_are_one_front_that_answers_alike(minilm_dir, demo_dir, embed_rt, served):
    assert cli.main(["serve", str(minilm_dir), "--backend", "transformers"]) == 0
    assert cli.main(["serve", str(minilm_dir), str(demo_dir), "--backend", "transformers"]) == 0
    one, several = served
    in_process = create_app(embed_rt)
    for app, names in ((one, [minilm_dir.name]), (several, [minilm_dir.name, demo_dir.name])):
        assert isinstance(app.state.registry, ModelRegistry) and list(app.state.registry.entries) == names
    assert one.state.registry.entries[minilm_dir.name].spec.pinned, "a model alone is loaded at startup and stays"
    assert one.state.registry.budget == launch.UNBOUNDED, "a model alone has no budget: its cache takes the free memory"
    assert routes(one) == routes(several) == routes(in_process)
    name = minilm_dir.name
    alike = answers(one, name)
    assert answers(several, name) == alike == answers(in_process, embed_rt.model_info().name)
    assert alike["chat to an embedding model"] == (
        400,
        "unsupported_task",
        f"/v1/chat/completions serves chat models; {name!r} is of kind 'embedding': send it to /v1/embeddings.",
    )
    assert alike["GET /v1/completions"] == (405, "method_not_allowed")
    assert alike["a body that is not JSON"] == (400, "invalid_json")
    assert alike["/health"] == (200, ("in_flight", "instance", "model", "models", "status"))
    assert several.state.registry.entries[demo_dir.name].state == "unloaded", "none of it loaded the chat model"


def test_a_served_name_is_the_id_and_the_model_also_answers_to_its_own(embed_rt):
    app = create_app(embed_rt, served_model_name="mini")
    with TestClient(app) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["mini"]
        for name in ("mini", embed_rt.model_info().name):
            r = client.post("/v1/embeddings", json={"model": name, "input": "a cat"})
            assert r.status_code == 200 and len(r.json()["data"]) == 1
        assert client.post("/v1/embeddings", json={"model": "other", "input": "a cat"}).status_code == 404
    assert not embed_rt.closed, "a runtime handed in is the caller's to close"
