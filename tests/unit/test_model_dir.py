"""Bad model directories: each a typed error that says what to do, found before anything loads."""

import json
import struct
from pathlib import Path

import pytest

from exllama_integrations import (
    BackendUnavailableError,
    ExLlamaRuntime,
    InvalidModelError,
    MissingDependencyError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from exllama_integrations.model.directory import ModelDirectory

from fixture_models import Shape, make_llama

TINY = Shape(hidden=64, layers=1, heads=2, kv_heads=2, inter=128, vocab=300)


@pytest.fixture()
def model(tmp_path: Path) -> Path:
    return make_llama(tmp_path / "m", TINY, device="cpu")


def test_missing_directory(tmp_path: Path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        ExLlamaRuntime(tmp_path / "nope")


def test_path_is_a_file(tmp_path: Path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ModelNotFoundError, match="is a file"):
        ModelDirectory.inspect(tmp_path / "f")


def test_empty_directory(tmp_path: Path):
    with pytest.raises(InvalidModelError, match="empty"):
        ModelDirectory.inspect(tmp_path)


def test_no_config(model: Path):
    (model / "config.json").unlink()
    with pytest.raises(InvalidModelError, match="no config.json"):
        ModelDirectory.inspect(model)


def test_malformed_config(model: Path):
    (model / "config.json").write_text("{not json")
    with pytest.raises(InvalidModelError, match="not valid JSON"):
        ModelDirectory.inspect(model)


def test_missing_weights(model: Path):
    (model / "model.safetensors").unlink()
    with pytest.raises(InvalidModelError, match="no \\*.safetensors"):
        ModelDirectory.inspect(model)


def test_pickle_weights_are_refused(model: Path):
    (model / "model.safetensors").rename(model / "pytorch_model.bin")
    with pytest.raises(InvalidModelError, match="only pickle"):
        ModelDirectory.inspect(model)


def test_truncated_weights(model: Path):
    w = model / "model.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[: len(data) // 2])
    with pytest.raises(InvalidModelError, match="truncated"):
        ModelDirectory.inspect(model)


def test_corrupt_header(model: Path):
    (model / "model.safetensors").write_bytes(struct.pack("<Q", 10) + b"\xff" * 10)
    with pytest.raises(InvalidModelError, match="corrupt"):
        ModelDirectory.inspect(model)


def test_index_pointing_outside_the_directory_is_refused(model: Path, tmp_path: Path):
    (model / "model.safetensors").rename(tmp_path / "outside.safetensors")
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "../outside.safetensors"}})
    )
    with pytest.raises(InvalidModelError, match="outside its directory"):
        ModelDirectory.inspect(model)


def test_index_with_missing_shard(model: Path):
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model.safetensors", "b": "model-00002.safetensors"}})
    )
    with pytest.raises(InvalidModelError, match="missing: model-00002"):
        ModelDirectory.inspect(model)


def test_no_tokenizer(model: Path):
    (model / "tokenizer.json").unlink()
    with pytest.raises(InvalidModelError, match="no tokenizer"):
        ModelDirectory.inspect(model)


def test_unsupported_architecture(model: Path):
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(model_type="totally_new_arch", architectures=["TotallyNewForCausalLM"], auto_map={"x": "y"})
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="trust_remote_code is never enabled"):
        ExLlamaRuntime(model, "transformers")


def test_quantized_model_on_cpu_names_the_gpu_backend(model: Path):
    cfg = json.loads((model / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="backend='exllama'"):
        ExLlamaRuntime(model, "transformers")


def test_weights_missing_tensors(model: Path):
    from safetensors.torch import load_file, save_file

    sd = load_file(str(model / "model.safetensors"))
    del sd["model.layers.0.mlp.up_proj.weight"]
    save_file(sd, str(model / "model.safetensors"))
    with pytest.raises(InvalidModelError, match="weights are missing"):
        ExLlamaRuntime(model, "transformers")


@pytest.mark.parametrize("backend", ["exllamav3", "exllama", "exllamav2"])
def test_gpu_backend_without_gpu_or_library_says_why(model: Path, backend: str):
    with pytest.raises((BackendUnavailableError, MissingDependencyError)) as e:
        ExLlamaRuntime(model, backend)
    assert backend in str(e.value) or "CUDA" in str(e.value)


def test_unknown_backend(model: Path):
    from exllama_integrations import InvalidSettingsError

    with pytest.raises(InvalidSettingsError, match="unknown backend"):
        ExLlamaRuntime(model, "vllm")


def test_exllama_v1_shape_limits_are_refused_before_loading():
    from exllama_integrations.backends.exllama import shape_problems

    assert (
        shape_problems(
            {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008}
        )
        == []
    )
    problems = shape_problems(
        {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 1376}
    )
    assert any("head_dim must be a multiple of 128" in p for p in problems)
    assert any(
        "num_key_value_heads must be a multiple of 4" in p
        for p in shape_problems(
            {"hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 2816}
        )
    )


def test_exl3_weights_with_padded_hidden_size_are_refused_before_loading(model: Path):
    from exllama_integrations.backends.exllamav3 import ExLlamaV3Backend

    cfg = json.loads((model / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "exl3", "bits": 4}
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=r"hidden_size 64 \(not a multiple of 128\).*fp16/bf16 weights"):
        ExLlamaV3Backend.check_model(ModelDirectory.inspect(model))


def test_a_server_warms_exllamav3_up_and_leaves_other_backends_and_choices_alone(demo_dir):
    from exllama_integrations.backends import backend_class
    from exllama_integrations.runtime.local import registry

    cpu, v3 = backend_class("transformers"), backend_class("exllamav3")
    assert registry.serving_options(cpu, {"num_threads": 1}) == {"num_threads": 1}
    assert registry.serving_options(cpu, {}, gpu_share=0.5) == {}  # no cache to size
    burst = {"burst_window": 0.02}
    want = {"cache_size": 4096, "warmup": True, **burst}
    assert registry.serving_options(v3, {"cache_size": 4096}) == want
    assert registry.serving_options(v3, {"warmup": False}) == {"warmup": False, **burst}
    half = registry.serving_options(v3, {}, gpu_share=0.5)  # a Ray replica at num_gpus=0.5
    assert half == {"warmup": True, "burst_window": 0.02, "memory_share": 0.5}
    assert registry.serving_options(v3, {"memory_share": 0.3}, gpu_share=0.5)["memory_share"] == 0.3
    plan = registry.plan_serving(demo_dir, "transformers", {"num_threads": 1})  # the plan a server loads from
    assert plan.backend is cpu and plan.options.num_threads == 1 and plan.model.path == demo_dir.resolve()


def test_a_multimodal_models_context_is_read_from_its_text_config(model: Path):
    """Gemma 4, Qwen3.5-VL and the like keep max_position_embeddings in text_config only: their context was read as
    2048 (the fallback), so a 2,279-token prompt to the Gemma 4 fixture (context 4096) was refused on the GPU."""
    config = json.loads((model / "config.json").read_text())
    text = dict(config)
    config.pop("max_position_embeddings")
    text["max_position_embeddings"] = 131072
    (model / "config.json").write_text(json.dumps({**config, "text_config": text}))
    assert ModelDirectory.inspect(model).context_length == 131072
