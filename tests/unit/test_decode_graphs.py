"""The rule of the captured decode step (``decode="fast"``): which forwards a CUDA graph may replay.

The capture itself and the identical tokens are proven on the GPU (tests/gpu/test_gpu_fast_decode.py,
benchmarks/gpu_fast_decode.py); here, on the CPU, the rule that sends every other forward to exllamav3's eager
one, since a wrong "yes" would replay a graph built for another kind of step.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from exllama_integrations.backends.exllamav3.fast import graphs as decode_graphs  # noqa: E402
from exllama_integrations.backends.exllamav3.fast.graphs import (  # noqa: E402
    LEFT_TO_EXLLAMAV3,
    DecodeGraphs,
    Shape,
    exported,
    step_stands_aside,
)

from helpers import decode_step  # noqa: E402

step = decode_step


def test_a_plain_decode_step_is_replayed() -> None:
    assert step_stands_aside(*step(16), min_rows=9) is None
    assert step_stands_aside(*step(1), min_rows=1) is None


def test_prefill_drafting_and_healing_run_eagerly() -> None:
    ids, params = step(4)
    assert step_stands_aside(torch.ones((4, 5), dtype=torch.long), params, 1) == "more than one position per row"
    assert step_stands_aside(None, params, 1) == "more than one position per row"


def test_a_draft_models_parameters_run_eagerly_and_are_named() -> None:
    ids, params = step(16, export_states=[], draft_conf=True)
    assert step_stands_aside(ids, params, 1) == "parameters ['draft_conf', 'export_states']"
    ids, params = step(16, inv_freq=torch.ones(64))  # a rope the graph was not captured with
    assert step_stands_aside(ids, params, 1) == "parameters ['inv_freq']"


def test_a_drafting_targets_undrafted_step_is_replayed_and_hands_its_hidden_state_back() -> None:
    """An MTP drafter's target exports its final norm's output every step: such a step is captured (the graph writes
    the output into a tensor of its own) and the replay hands it back as exllamav3's norm does, a copy each time."""
    ids, params = step(16, export_state_norm_keys={"model.norm"})
    assert step_stands_aside(ids, params, 9, recurrent=True) is None
    assert exported(params) == ("model.norm",) and exported(step(16)[1]) == ()
    shape = Shape(16, 16, exported(params))
    shape.exported = [torch.arange(6.0).view(2, 1, 3)]  # what the captured norm writes at every replay
    shape.hand_back(params)
    shape.hand_back(params)  # (a second norm's output appends, as exllamav3's norms append)
    assert len(params["export_states"]) == 2 and torch.equal(params["export_states"][0], shape.exported[0])
    shape.exported[0].zero_()  # the next replay rewrites the graph's tensor: what was handed back keeps this step's
    assert params["export_states"][0].sum() == 15
    assert "export_states" not in step(16)[1]


def test_images_recurrent_state_and_explicit_positions_run_eagerly() -> None:
    ids, params = step(16, indexed_embeddings=[object()])
    assert step_stands_aside(ids, params, 1) == "image embeddings or a speculative pass"
    ids, params = step(16, recurrent_history=True)
    assert step_stands_aside(ids, params, 1) == "image embeddings or a speculative pass"
    assert step_stands_aside(ids, params, 1, recurrent=True) == "image embeddings or a speculative pass"
    # a step over recurrent state: eager on a model whose recurrent layers are not captured, captured where they are
    ids, params = step(16, recurrent_states=[object()] * 16)
    assert step_stands_aside(ids, params, 1) == "recurrent state"
    assert step_stands_aside(ids, params, 9, recurrent=True) is None
    ids, params = step(8, recurrent_states=[object()] * 8)
    assert step_stands_aside(ids, params, 9, recurrent=True) == f"up to 8 rows {LEFT_TO_EXLLAMAV3}"
    ids, params = step(16, positions=torch.zeros(16, dtype=torch.int32))
    assert step_stands_aside(ids, params, 1) == "explicit positions"


def test_unpaged_attention_runs_eagerly() -> None:
    ids, params = step(16, attn_mode="flash_attn_nc")
    assert step_stands_aside(ids, params, 1) == "not a paged decode step"
    ids, params = step(16)
    del params["block_table"]
    assert step_stands_aside(ids, params, 1) == "not a paged decode step"


def test_below_min_rows_a_step_is_left_to_exllamav3s_own_graphs() -> None:
    ids, params = step(8)
    assert step_stands_aside(ids, params, min_rows=9) == "up to 8 rows (left to exllamav3's own per-layer graphs)"
    assert step_stands_aside(*step(9), min_rows=9) is None
    assert step_stands_aside(*step(1)) is None  # by default every row count is captured, one row included


class FakeModel:
    loaded_tp = False
    modules: list[Any] = []


def test_without_exllamav3_every_forward_is_eager_and_the_report_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_exllamav3(name: str, *a: Any, **k: Any) -> Any:
        if name.startswith("exllamav3"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_exllamav3)
    graphs = DecodeGraphs(FakeModel())  # the default min_rows too: it must not need exllamav3 to stand aside
    calls = []
    ids, params = step(16)
    out = graphs.forward(lambda i, p: calls.append(i) or "eager logits", ids, params)
    assert out == "eager logits" and calls == [ids]
    report = graphs.report()
    assert report["captured"] is False and "exllamav3's modules do not import" in report["stands_aside"]
    assert graphs.eager == {"the model": 1}
    assert decode_graphs.MAX_GRAPHS >= 64  # every batch size up to a generator's usual 64 can have its graph
    graphs.close()  # standing aside, it holds nothing; closing is safe all the same


# ---------------------------------------------------------------------- running ahead: when, and when its logits count


def test_a_step_runs_ahead_only_where_every_row_owns_its_next_position() -> None:
    from exllama_integrations.backends.exllamav3.fast.run_ahead import ahead_stands_aside

    key = (2, 16)  # 2 rows, a block table 16 pages wide; pages of 256 positions
    assert ahead_stands_aside(key, [300, 700], [5, 6], [2, 3], 256) is None
    # the second row's next position is the first of a page it has not been given (its job ends there)
    assert ahead_stands_aside(key, [300, 768], [5, 6], [2, 3], 256) == "a row at the end of its pages"
    # past the block table's width: the graph's table has no column for it
    assert ahead_stands_aside((2, 1), [300, 100], [5, 6], [2, 2], 256) == "a row at the end of its pages"
    assert ahead_stands_aside(key, [300, 700], [5], [2, 3], 256) == "tokens and rows differ"  # a job drew no token


def ran_ahead(ids: Any, params: dict[str, Any]) -> Any:
    """The record of a forward run ahead on the inputs ``ids`` / ``params`` would have (its shape left out)."""
    from exllama_integrations.backends.exllamav3.fast.run_ahead import Ahead

    bt = params["block_table"]
    return Ahead((int(bt.shape[0]), int(bt.shape[1])), None, ids.clone(), bt.clone(), params["cache_seqlens"].clone())


def test_the_logits_run_ahead_count_only_for_the_very_same_inputs() -> None:
    from exllama_integrations.backends.exllamav3.fast.run_ahead import ahead_differs

    ids, params = step(4)
    ahead = ran_ahead(ids, params)
    assert ahead_differs(ahead, ids, params) is None
    assert ahead_differs(ahead, ids.clone(), dict(params)) is None  # equal values, other tensors: the same step

    other_ids = ids.clone()
    other_ids[2, 0] = 9  # a row's input token is another (token healing, a forced token)
    assert ahead_differs(ahead, other_ids, params) == "other input tokens"

    rewound = dict(params, cache_seqlens=params["cache_seqlens"] - 3)  # a job rewound (banned strings)
    assert ahead_differs(ahead, ids, rewound) == "other positions or pages (a rewind, a requeue, a defragmentation)"
    moved = dict(params, block_table=params["block_table"] + 1)  # pages moved (defragmentation)
    assert ahead_differs(ahead, ids, moved) == "other positions or pages (a rewind, a requeue, a defragmentation)"

    fewer_ids, fewer = step(3)  # a job ended on a stop string: one row fewer
    assert ahead_differs(ahead, fewer_ids, fewer) == "other rows or pages (a job ended, began or moved)"


def test_a_forward_that_is_not_the_step_run_ahead_discards_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever forward comes next, the record is dropped: a stale one is never compared with a later step."""
    graphs = DecodeGraphs(FakeModel())  # no exllamav3 here: every forward is eager
    ids, params = step(16)
    graphs._ahead = ran_ahead(ids, params)  # noqa: SLF001 - as launch_ahead leaves it
    assert graphs.forward(lambda i, p: "eager logits", ids, params) == "eager logits"
    assert graphs.ahead_missed == {"the step ran eagerly": 1} and graphs.ahead_used == 0
    assert graphs.forward(lambda i, p: "eager logits", ids, params) == "eager logits"
    assert graphs.ahead_missed == {"the step ran eagerly": 1}  # counted once: the record went with the first
    assert graphs.launch_ahead([1] * 16, [4] * 16) is False  # nothing was replayed, so nothing runs ahead


def test_only_a_replayed_step_can_be_run_ahead_of() -> None:
    graphs = DecodeGraphs(FakeModel())  # no exllamav3 here: every forward is eager, none replayed
    assert graphs.ahead and not graphs.can_launch
    ids, params = step(16)
    graphs.forward(lambda i, p: "eager logits", ids, params)
    assert not graphs.can_launch  # the fast path skips its rule's walk over the jobs at such a step
