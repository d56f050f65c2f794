"""``draft="mtp"`` without a GPU: the option and its refusals, the check for a checkpoint's MTP heads (on the Qwen3.5
fixture of tests/arch_families.py, with and without its head), ``serve --draft mtp``, the driver's count of accepted
drafts, and the benchmark's checkpoint (tests/mtp_models.py) counting upward on the CPU reference backend.

exllamav3 itself drafts on the lent GPU (tests/gpu/test_gpu_mtp.py, benchmarks/gpu_mtp.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path

import pytest
from arch_families import ARCHS_2026
from arch_models import make_arch

from exllama_integrations.backends import options_for
from exllama_integrations.backends.base import BackendRequest, TokenStep
from exllama_integrations.backends.exllamav3 import ExLlamaV3Backend
from exllama_integrations.backends.exllamav3.mtp import mtp_layers
from exllama_integrations.backends.exllamav3.options import ExLlamaV3Options, cache_kwargs
from exllama_integrations.backends.exllamav3.translate import DraftCounts, LiveJob
from exllama_integrations.contract.settings import GenerationSettings
from exllama_integrations.errors import InvalidSettingsError, UnsupportedModelError
from exllama_integrations.model.directory import ModelDirectory

ROOT = Path(__file__).resolve().parents[2]


def _options(**kw):
    return options_for(ExLlamaV3Backend, kw)


def test_draft_mtp_is_a_load_option_beside_the_other_drafters_and_refused_with_them():
    o = _options(draft="mtp", num_draft_tokens=3)
    assert o.draft == "mtp" and o.drafting and o.key() != _options().key()
    assert cache_kwargs(o) == {"max_history": 3}  # a recurrent model rolls back a rejected window of 3
    assert cache_kwargs(_options(draft="mtp"), default_draft=2) == {"max_history": 2}  # the head's own default
    assert cache_kwargs(_options()) == {}
    with pytest.raises(InvalidSettingsError, match="draft_model_dir and draft are 2 ways to draft: choose one"):
        _options(draft="mtp", draft_model_dir="/d")
    with pytest.raises(InvalidSettingsError, match="draft and ngram_match_min are 2 ways"):
        _options(draft="mtp", ngram_match_min=2)
    with pytest.raises(InvalidSettingsError, match="draft: Input should be 'mtp'"):
        _options(draft="eagle")
    with pytest.raises(InvalidSettingsError, match="num_draft_tokens needs draft_model_dir, draft='mtp' or ngram"):
        _options(num_draft_tokens=4)
    with pytest.raises(InvalidSettingsError, match=r"a drafted step \(draft\) verifies every job's window in one"):
        _options(draft="mtp", deterministic=True, prefill="exllamav3")


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    """Qwen3.5 (tests/arch_families.py, tiny) with its MTP head, and built without it (config.json still names one)."""
    root = tmp_path_factory.mktemp("mtp")
    arch = ARCHS_2026["qwen3_5"]
    return make_arch(arch, root / "with"), make_arch(dataclasses.replace(arch, mtp=False), root / "without")


def test_draft_mtp_needs_the_checkpoints_heads_and_says_what_is_missing(qwen3_5, tmp_path):
    with_heads, without = (ModelDirectory.inspect(p) for p in qwen3_5)
    assert mtp_layers(_options(draft="mtp"), with_heads) == 1
    assert mtp_layers(_options(), without) == 0  # not asked for: nothing checked
    with pytest.raises(UnsupportedModelError, match=r"declares 1 MTP layer\(s\) \(mtp_num_hidden_layers\) but its "):
        mtp_layers(_options(draft="mtp"), without)  # the weights lack mtp.*, as some quantizations leave them
    for count in (None, 0):
        shutil.copytree(with_heads.path, tmp_path / str(count))
        config = json.loads((tmp_path / str(count) / "config.json").read_text())
        config["mtp_num_hidden_layers"] = count
        (tmp_path / str(count) / "config.json").write_text(json.dumps(config))
        with pytest.raises(UnsupportedModelError, match="declares none: its config.json sets no positive mtp_num"):
            mtp_layers(_options(draft="mtp"), ModelDirectory.inspect(tmp_path / str(count)))
    # GLM and DeepSeek-V3 keep their head as the layer past the trunk, counted by num_nextn_predict_layers
    glm = dataclasses.replace(
        without,
        config={**without.config, "mtp_num_hidden_layers": 0, "num_nextn_predict_layers": 1},
        tensor_shapes={**without.tensor_shapes, "model.layers.4.eh_proj.weight": (64, 128)},
    )
    assert mtp_layers(_options(draft="mtp"), glm) == 1


def test_draft_mtp_reaches_the_backend_from_every_door_and_the_cpu_backend_refuses_it(qwen3_5, capsys):
    from exllama_integrations import ExLlamaRuntime
    from exllama_integrations.cli import main
    from exllama_integrations.langchain import ExLlamaLLM
    from exllama_integrations.llama_index import ExLlamaLLM as IndexLLM
    from exllama_integrations.serve.launch import load_options

    path = str(qwen3_5[0])
    args = argparse.Namespace(max_seq_len=None, dtype=None, option=["num_draft_tokens=3"], draft="mtp")
    options = options_for(ExLlamaV3Backend, load_options(args))  # serve --draft mtp --option num_draft_tokens=3
    assert isinstance(options, ExLlamaV3Options) and (options.draft, options.num_draft_tokens) == ("mtp", 3)
    assert main(["serve", path, "--backend", "transformers", "--draft", "mtp", "--engine", "thread"]) == 2
    err = capsys.readouterr().err
    assert "InvalidSettingsError" in err and "unknown option(s) for backend 'transformers': 'draft'" in err
    with pytest.raises(SystemExit):
        main(["serve", path, "--draft", "eagle"])
    assert "invalid choice: 'eagle'" in capsys.readouterr().err
    for load in (
        lambda: ExLlamaRuntime(path, "transformers", draft="mtp"),
        lambda: ExLlamaLLM(model_dir=path, backend="transformers", backend_options={"draft": "mtp"}),
        lambda: IndexLLM(model_dir=path, backend="transformers", backend_options={"draft": "mtp"}),
    ):
        with pytest.raises(InvalidSettingsError, match="'draft'"):
            load()


class _Ids(list):
    """A result's ``token_ids`` (a tensor in exllamav3): flattened and listed."""

    def flatten(self):
        return self

    def tolist(self):
        return list(self)


def test_the_driver_counts_each_finished_jobs_accepted_and_rejected_drafts():
    from exllama_integrations.backends.exllamav3.driver import Driver
    from exllama_integrations.backends.inbox import Inbox

    counts = DraftCounts("MTP heads", 4)
    assert counts.report()["acceptance"] is None
    d = Driver(object(), Inbox(0.0), lambda req: (object(), False), lambda req: None, drafts=counts)
    for accepted, rejected in ((30, 2), (12, 20)):
        steps: list[TokenStep] = []
        e = LiveJob(object(), BackendRequest([1], GenerationSettings(), 8, frozenset(), steps.append))
        d._deliver({"job": e.job, "stage": "streaming", "token_ids": _Ids([5]), "accepted_draft_tokens": 9}, e, 1)
        end = {"job": e.job, "stage": "streaming", "token_ids": _Ids([6]), "eos": True, "eos_reason": "max_new_tokens"}
        assert d._deliver({**end, "accepted_draft_tokens": accepted, "rejected_draft_tokens": rejected}, e, 1)
        assert steps[-1].finish == "length" and steps[-1].token_ids == (6,)
    d._deliver({**end, "job": object()}, LiveJob(object(), e.req), 1)  # a job without counts (no drafting)
    assert counts.report() == {
        "mode": "MTP heads",
        "num_draft_tokens": 4,
        "jobs": 2,
        "accepted_draft_tokens": 42,
        "rejected_draft_tokens": 22,
        "acceptance": round(42 / 64, 4),
    }


def test_the_benchmarks_checkpoint_counts_upward_and_its_heads_acceptance_is_known(qwen3_5, tmp_path):
    from mtp_models import TINY, window_acceptance
    from safetensors import safe_open

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_mtp import PROMPT, prepare

    from exllama_integrations import ExLlamaRuntime

    fixture = prepare(tmp_path, TINY, new=96, window=4, target=0.7, device="cpu")
    perfect, mix = (fixture["levels"][k] for k in ("perfect", "mix"))

    def layout(path: Path) -> dict[str, tuple[int, ...]]:
        out = {}
        for f in path.glob("*.safetensors"):
            with safe_open(str(f), "pt") as h:
                out |= {k: tuple(h.get_slice(k).get_shape()) for k in h.keys()}  # noqa: SIM118
        return out

    assert layout(Path(perfect["dir"])) == layout(qwen3_5[0])  # key for key what transformers writes for Qwen3.5
    assert mtp_layers(_options(draft="mtp"), ModelDirectory.inspect(mix["dir"])) == 1
    rt = ExLlamaRuntime(perfect["dir"], "transformers")  # transformers' own Qwen3_5ForCausalLM reads it
    try:
        assert rt.encode(PROMPT)[-1] == fixture["start"]
        out = rt.generate(PROMPT, temperature=0, max_new_tokens=12, ignore_eos=True).token_ids
    finally:
        rt.close()
    assert list(out) == [fixture["start"] + 1 + i for i in range(12)]  # the next token is the current one + 1
    # exllamav3's accounting of a 96-token job drafting 4 a step: always right, all but the last window's tail
    assert window_acceptance(lambda t: True, 0, 96, 4) == (76, 4)  # 19 whole windows, then the job ends a window
    assert window_acceptance(lambda t: False, 0, 96, 4) == (0, 96 * 4)
    assert perfect["sigma"] == 0 and perfect["predicted_acceptance"] == round(76 / 80, 4)
    assert mix["sigma"] > 0 and abs(mix["predicted_acceptance"] - 0.7) < 0.1


def test_auto_cache_sizing_counts_the_mtp_heads_own_cache(monkeypatch):
    import torch

    from exllama_integrations.backends.exllamav3.options import auto_cache_tokens, cache_bytes_per_token

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=0: (40 * 2**30, 80 * 2**30))
    config = {"num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256}
    file = type("F", (), {"stat": lambda self: type("S", (), {"st_size": 2**30})()})()
    model = type("M", (), {"config": config, "text_config": config, "weight_files": [file]})()
    _, plain = auto_cache_tokens(model, _options(), 4096)
    _, drafting = auto_cache_tokens(model, _options(draft="mtp"), 4096, mtp_layers=1)
    one_layer = cache_bytes_per_token({**config, "num_hidden_layers": 1}, None)
    assert drafting["bytes_per_token"] == plain["bytes_per_token"] + one_layer
