"""Embedding and rerank values: their wire forms both ways, what they refuse, the files that say how to pool."""

from __future__ import annotations

import json

import pytest

from exllama_integrations.contract import wire
from exllama_integrations.contract.retrieval import (
    EmbeddingInfo,
    EmbeddingRequest,
    EmbeddingResult,
    RerankHit,
    RerankRequest,
    RerankResult,
)
from exllama_integrations.errors import (
    InputTooLongError,
    InvalidSettingsError,
    ProtocolError,
    UnsupportedModelError,
    error_from_wire,
    error_to_wire,
)


def test_each_value_crosses_the_wire_unchanged():
    values = [
        EmbeddingRequest(["a cat", [1, 2, 3]], input_type="query", truncate=True, dimensions=16),
        EmbeddingResult.from_vectors([[0.25, -1.5], [3.0, 0.125]], prompt_tokens=7, model="m"),
        RerankRequest("q", ["a", "b"], top_n=1, instruction="judge"),
        RerankResult((RerankHit(1, 0.75), RerankHit(0, 0.25)), 9, "m"),
        EmbeddingInfo("m", "embed", "transformers", 256, 384, True, "mean", (64, 128), {"query": "q: "}),
    ]
    readers = [
        wire.loads_embedding_request,
        wire.loads_embedding_result,
        wire.loads_rerank_request,
        wire.loads_rerank_result,
        wire.loads_embedding_info,
    ]
    for value, read in zip(values, readers):
        assert read(wire.dumps(value)) == value
    data = json.loads(wire.dumps(values[1]))
    assert isinstance(data["data"], str)  # the vectors travel as base64 float32
    assert wire.loads_embedding_result(data).vectors == [[0.25, -1.5], [3.0, 0.125]]


@pytest.mark.parametrize(
    "body",
    [
        {"inputs": []},
        {"inputs": "one text, not a list"},
        {"inputs": [[]]},
        {"inputs": [[1, -2]]},
        {"inputs": ["x"], "input_type": "passage"},
        {"inputs": ["x"], "dimensions": 0},
        {"inputs": ["x"] * 2049},
    ],
)
def test_a_bad_embedding_request_is_refused_typed(body):
    with pytest.raises(InvalidSettingsError):
        wire.loads_embedding_request(json.dumps(body))


def test_a_server_that_sends_the_wrong_number_of_bytes_is_a_protocol_error():
    with pytest.raises(ProtocolError, match="needs 16 bytes"):
        wire.loads_embedding_result({"data": "AAAA", "count": 2, "dimensions": 2})
    with pytest.raises(InvalidSettingsError):
        RerankRequest("q", ["a"], top_n=0)


def test_input_too_long_crosses_the_wire_with_its_fields():
    back = error_from_wire(error_to_wire(InputTooLongError(3, 300, 256, "'m'")))
    assert isinstance(back, InputTooLongError) and back.status == 400
    assert (back.input_index, back.prompt_tokens, back.context_length) == (3, 300, 256)


def test_matryoshka_dimensions_only_where_declared():
    info = EmbeddingInfo("m", "embed", "transformers", 256, 384, matryoshka_dimensions=(128, 256))
    info.check_dimensions(256)
    for bad in (100, 512):
        with pytest.raises(InvalidSettingsError):
            info.check_dimensions(bad)
    EmbeddingInfo("m", "embed", "transformers", 256, 384, matryoshka_dimensions=()).check_dimensions(100)


def test_a_pipeline_module_not_computed_here_is_refused_by_name(tmp_path, minilm_dir):
    import shutil

    from exllama_integrations.model.directory import ModelDirectory
    from exllama_integrations.model.pooling import read_pooling

    model = tmp_path / "dense"
    shutil.copytree(minilm_dir, model)
    modules = json.loads((model / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (model / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(UnsupportedModelError, match="Dense"):
        read_pooling(ModelDirectory.inspect(model))
    config = read_pooling(ModelDirectory.inspect(minilm_dir))
    assert (config.task, config.modes, config.normalize, config.max_tokens) == ("embed", ("mean",), True, 256)


def test_serve_finds_what_a_directory_is_for(minilm_dir, demo_dir, tmp_path):
    import shutil

    from exllama_integrations.serve.registry.config import ModelSpec
    from exllama_integrations.serve.registry.kinds import kind_of

    def task_of(path: str) -> str:  # what serve finds a directory is for: its kind
        return kind_of(ModelSpec("m", path))

    assert task_of(str(minilm_dir)) == "embedding"
    assert task_of(str(demo_dir)) == "chat"
    head = tmp_path / "head"
    shutil.copytree(minilm_dir, head, ignore=shutil.ignore_patterns("modules.json", "1_Pooling"))
    config = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**config, "architectures": ["BertForSequenceClassification"]}))
    assert task_of(str(head)) == "rerank"
