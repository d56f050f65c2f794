"""The typed calls the seam hands the fast path's features, built from the params exllamav3 1.6.5 builds.

A decode step (``Generator.iterate_gen``'s params) and a prompt chunk (``Job.prefill``'s) are made here with the keys
recorded from exllamav3 1.6.5's own source (upstream/recorded/), so a release that changes them changes these too.
That the features act on them on the GPU as before is tests/gpu/test_gpu_fast_decode.py's.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from exllama_integrations.backends.exllamav3.fast import graphs  # noqa: E402
from exllama_integrations.backends.exllamav3.fast.deterministic import row_width  # noqa: E402
from exllama_integrations.backends.exllamav3.fast.prefill import call_stands_aside  # noqa: E402
from exllama_integrations.backends.exllamav3.fast.requirements import PAGE_SIZE  # noqa: E402
from exllama_integrations.backends.exllamav3.fast.step import TABLE_PAD, Forward, PageCopy, padded_width  # noqa: E402
from exllama_integrations.backends.exllamav3.upstream import depends  # noqa: E402

RECORDED = depends.recorded("1.6.5")


def _keys(where: str) -> list[str]:
    assert RECORDED is not None
    keys = RECORDED["facts"][f"{where}:params"]["keys"]
    assert keys and "block_table" in keys and "cache_seqlens" in keys
    return list(keys)


def _recorded_params(where: str, rows: int, width: int, cache: object) -> dict[str, Any]:
    """A params dict with the recorded keys, as exllamav3 fills them for a plain text step (the rest None)."""
    params: dict[str, Any] = dict.fromkeys(_keys(where))
    params.update(
        attn_mode="flash_attn",
        block_table=torch.arange(rows * width, dtype=torch.int32).view(rows, width),
        cache_seqlens=torch.arange(rows, dtype=torch.int32) * 300,
        cache=cache,
    )
    return params


class Eager:
    """exllamav3's own method: records how it was called."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> str:
        self.calls.append((args, kwargs))
        return "exllamav3's own"


def test_a_decode_step_is_read_once_from_exllamav3s_keyword_call() -> None:
    eager, cache = Eager(), object()
    ids = torch.zeros((3, 1), dtype=torch.long)
    params = _recorded_params("exllamav3.generator.generator:Generator.iterate_gen", 3, 16, cache)
    call = Forward.of(eager, (), {"input_ids": ids, "params": params})
    assert call.step and call.rows == 3 and call.ids is ids and call.params is params
    assert call.block_table is params["block_table"] and call.cache_seqlens.tolist() == [0, 300, 600]
    assert call.positions is None and call.recurrent_states is None  # a plain text step
    assert graphs.step_stands_aside(call.ids, call.params) is None  # what the captured step takes
    assert call.run() == "exllamav3's own" and eager.calls[-1] == ((), {"input_ids": ids, "params": params})
    row = {"block_table": params["block_table"][:1]}
    call.run_as(ids[:1], row)
    assert eager.calls[-1] == ((), {"input_ids": ids[:1], "params": row})


def test_any_other_call_shape_is_not_a_step_and_runs_as_it_was_made() -> None:
    eager, ids = Eager(), torch.zeros((2, 1), dtype=torch.long)
    for args, kwargs in (((ids, {}), {}), ((ids,), {"params": {}}), ((), {"input_ids": ids})):
        call = Forward.of(eager, args, kwargs)
        assert not call.step and call.block_table is None and call.positions is None
        call.run()
        assert eager.calls[-1] == (args, kwargs)


def test_a_prompt_chunk_is_held_only_in_the_shape_job_prefill_calls() -> None:
    eager, cache = Eager(), object()
    params = _recorded_params("exllamav3.generator.job:Job.prefill", 1, 4, cache)
    params["cache_seqlens"] = torch.tensor([0], dtype=torch.int32)
    ids = torch.arange(7).view(1, 7)
    assert call_stands_aside(Forward.of(eager, (), {"input_ids": ids, "params": params}), cache) is None
    assert call_stands_aside(Forward.of(eager, (ids, params), {}), cache) == "not a Job's chunk"
    assert call_stands_aside(Forward.of(eager, (), {"input_ids": ids, "params": params}), object()) == (
        "other parameters"  # another cache's chunk
    )


def test_a_page_copy_within_the_cache_says_its_pages_and_any_other_runs_as_made() -> None:
    eager, cache = Eager(), object()
    copy = PageCopy.of(eager, (cache, 3, 7, 100), {}, cache)
    assert copy.pages == (3, 7, 100)
    assert PageCopy.of(eager, (object(), 3, 7, 100), {}, cache).pages is None  # into another cache
    other = PageCopy.of(eager, (cache, 3, 7), {"num_tokens": 100}, cache)
    assert other.pages is None
    other.run()
    assert eager.calls[-1] == ((cache, 3, 7), {"num_tokens": 100})


def test_the_16_page_padding_rule_is_said_once() -> None:
    assert TABLE_PAD == 16 and graphs.LOAD_WIDTH == TABLE_PAD
    assert [padded_width(p) for p in (1, 16, 17, 32, 33)] == [16, 16, 32, 32, 48]
    assert all(row_width(pos, PAGE_SIZE) == padded_width(pos // PAGE_SIZE + 1) for pos in range(0, 20_000, 97))
