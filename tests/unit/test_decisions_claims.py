"""docs/decisions.md's numbers are the committed benchmarks: each median [min..max] in "## The numbers" is a summary
of benchmarks/results/cpu_decisions.json or gpu_decisions_run{1,2}_h100.json, and the ratios its prose quotes are what
the rows say."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NUM = r"\d+(?:\.\d+)?"
GPU_RUNS = ("cpu_decisions.json", "gpu_decisions_run1_h100.json", "gpu_decisions_run2_h100.json")
TRIPLE = re.compile(rf"({NUM})(?: s)? \[({NUM})\.\.({NUM})\]")


def _same(text: str, value: float) -> bool:
    decimals = len(text.split(".")[1]) if "." in text else 0
    return abs(round(value, decimals) - float(text)) < 10 ** -(decimals + 3)


def _section() -> str:
    page = (ROOT / "docs" / "decisions.md").read_text()
    start = page.index("## The numbers")
    end = page.find("\n## ", start + 1)
    return page[start : end if end > 0 else len(page)]


def test_every_quoted_median_min_max_is_a_committed_summary() -> None:
    summaries = []
    for name in GPU_RUNS:
        data = json.loads((ROOT / "benchmarks" / "results" / name).read_text())
        summaries += [
            *(v["seconds"] for rows in data["rows"].values() for v in rows.values()),
            *(v["seconds"] for pairs in data["ratios"].values() for v in pairs.values()),
        ]
    quoted = TRIPLE.findall(_section())
    assert len(quoted) == 24  # the CPU's and the GPU runs' two rows: three paths' seconds and the JSON / decision ratio
    for median, lo, hi in quoted:
        assert any(_same(median, s["median"]) and _same(lo, s["min"]) and _same(hi, s["max"]) for s in summaries), (
            f"{median} [{lo}..{hi}] is no committed result"
        )


def test_the_prose_ratios_are_the_rows() -> None:
    data = json.loads((ROOT / "benchmarks" / "results" / "cpu_decisions.json").read_text())
    text = _section()
    floors = [data["ratios"][s]["one_token_generation / decision"]["seconds"]["median"] for s in data["rows"]]
    assert f"({floors[0]:.2f} and {floors[1]:.2f} per" in text  # the decision costs what reading its prompt costs
    bound = [
        data["rows"][s]["json_generation"]["seconds"]["median"]
        / data["rows"][s]["one_token_generation"]["seconds"]["median"]
        for s in data["rows"]
    ]
    assert f"({bound[0]:.1f} and {bound[1]:.1f} by their medians)" in text
    ratios = [data["ratios"][s]["json_generation / decision"]["seconds"]["median"] for s in data["rows"]]
    assert f"{ratios[0]:.1f}x to {ratios[1]:.1f}x faster, not the 5x" in text and max(ratios) < 5


def test_the_gpu_prose_ratios_are_the_rows() -> None:
    data = json.loads((ROOT / "benchmarks" / "results" / "gpu_decisions_run1_h100.json").read_text())
    text = _section()
    rows = [data["rows"][s] for s in ("one_choice", "three_questions")]
    floor = [r["one_token_generation"]["seconds"]["median"] for r in rows]
    json_over_floor = [r["json_generation"]["seconds"]["median"] / f for r, f in zip(rows, floor)]
    decision_over_floor = [r["decision"]["seconds"]["median"] / f for r, f in zip(rows, floor)]
    assert f"({json_over_floor[0]:.1f}x and {json_over_floor[1]:.1f}x the one-token generation" in text
    assert f"The decision pays {decision_over_floor[0]:.1f}x and {decision_over_floor[1]:.1f}x the floor" in text
    ratios = [data["ratios"][s]["json_generation / decision"]["seconds"]["median"] for s in data["rows"]]
    assert "Here the decision is the slower path" in text and max(ratios) < 1


def test_the_new_paths_gpu_run_is_what_the_prose_says() -> None:
    """Run 2 measured the path that runs one question in 1 forward and three in 3 (run 1's path took 3 and 5)."""
    data = json.loads((ROOT / "benchmarks" / "results" / "gpu_decisions_run2_h100.json").read_text())
    text = _section()
    forwards = [{r["forwards"] for r in data["runs"][s]["decision"]} for s in ("one_choice", "three_questions")]
    assert forwards == [{1}, {3}]
    assert "in 1 and 3\nforwards instead of 3 and 5" in text and "1 and 3 in\nevery round" in text
    rows = [data["rows"][s] for s in ("one_choice", "three_questions")]
    floor = [r["one_token_generation"]["seconds"]["median"] for r in rows]
    over = [r["decision"]["seconds"]["median"] / f for r, f in zip(rows, floor)]
    json_over = [r["json_generation"]["seconds"]["median"] / f for r, f in zip(rows, floor)]
    ratios = [data["ratios"][s]["json_generation / decision"]["seconds"]["median"] for s in data["rows"]]
    assert over[0] < 1 and f"({over[0]:.1f}x the floor by the medians)" in text
    assert f"{ratios[0]:.2f}x JSON generation,\nwhere JSON pays {json_over[0]:.1f}x the floor" in text
    assert f"{over[1]:.1f}x the floor against JSON's {json_over[1]:.1f}x, a narrow {ratios[1]:.2f}x" in text
    assert min(ratios) > 1 and "so the decision is the faster path" in text
    slowest = max(r["seconds"] for r in data["runs"]["three_questions"]["decision"])
    assert f"one round of the decision took {slowest:.1f} s" in text


def test_the_bound_on_json_over_decision_is_the_committed_rows_json_over_the_floor() -> None:
    bounds = []
    for name in GPU_RUNS:
        rows = json.loads((ROOT / "benchmarks" / "results" / name).read_text())["rows"]
        bounds += [
            r["json_generation"]["seconds"]["median"] / r["one_token_generation"]["seconds"]["median"]
            for r in rows.values()
        ]
    text = _section()
    assert f"{min(bounds):.1f}x to {max(bounds):.1f}x on these rows (CPU and GPU), never the 5x" in text
    assert max(bounds) < 5


def test_the_exllamav3_rows_constants_are_the_plans() -> None:
    from exllama_integrations.backends.exllamav3.decision_plan import FUSED_TOKENS, LABEL_ROWS
    from exllama_integrations.backends.exllamav3.fast.requirements import PAGE_SIZE

    page = (ROOT / "docs" / "decisions.md").read_text()
    (row,) = [line for line in page.splitlines() if line.startswith("| exllamav3 |")]
    assert f"chunked by pages ({PAGE_SIZE} tokens) from position 0" in row
    assert f"when they are at most {LABEL_ROWS} and {FUSED_TOKENS} tokens in all" in row
    assert f"({LABEL_ROWS} a forward)" in row
