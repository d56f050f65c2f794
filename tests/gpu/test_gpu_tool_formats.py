"""Forced tool calls in each family's own syntax, on exllamav3 (the grammar as exllamav3's filter).

Each tool-calling family (tests/tool_families.py) is built by transformers' own classes at a realistic width
(``size="gpu"``: hidden 1024, 8 layers, vocab 32000, bf16) with its chat template and control tokens, loaded on
exllamav3, and asked with ``tool_choice="required"`` and with a named tool: the model (random weights) must write
calls in its family's syntax that the family's reader reads back, with arguments valid under the tool's schema.
A family exllamav3 cannot run is refused with a typed error (GPT-OSS: its logits do not match the oracle), and
its harmony format is checked on the CPU reference instead. One line per family goes to
``$OUT/tool_formats.jsonl``.

Run on the lent GPU: ``pytest -m gpu tests/gpu/test_gpu_tool_formats.py``. Skipped without CUDA.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from tool_families import FAMILIES, FAMILIES_TOKENIZER_ONLY, TOOLS, make_family

pytestmark = pytest.mark.gpu
RESULTS = Path(os.environ.get("OUT", "/tmp/out")) / "tool_formats.jsonl"
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def _bounded(schema):
    if isinstance(schema, dict):
        out = {k: _bounded(v) for k, v in schema.items()}
        if out.get("type") == "string" and "enum" not in out:
            out["maxLength"] = 16  # a random-weight model writes a free string until it is cut
        return out
    return [_bounded(v) for v in schema] if isinstance(schema, list) else schema


FORCED = _bounded(TOOLS)
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in FORCED}


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in FAMILIES_TOKENIZER_ONLY])
def test_forced_calls_in_the_family_syntax_on_exllamav3(family, tmp_path):
    import jsonschema

    from exllama_integrations import ExLlamaRuntime, UnsupportedModelError
    from exllama_integrations.chat.formats import FORMATS
    from exllama_integrations.chat.outcome import stream_chat
    from exllama_integrations.chat.prepare import ChatRequest, prepare_chat
    from exllama_integrations.contract.api import GenerationSettings

    path = make_family(family, tmp_path / family, size="gpu", seed=11, device="cuda")
    record: dict[str, object] = {"family": family, "format": FAMILIES[family].tool_format, "backend": "exllamav3"}
    try:
        rt = ExLlamaRuntime(path, "exllamav3", cache_size=4096)
    except UnsupportedModelError as e:
        record.update(status="refused", why=str(e)[:300])
        _write(record)
        pytest.skip(f"refused, typed: {e}")
    fmt = FORMATS[FAMILIES[family].tool_format]
    try:
        assert rt.model_info().tool_format == fmt.name
        settings = GenerationSettings(temperature=0, max_new_tokens=700, max_reasoning_tokens=8)
        seen = []
        for choice in ("required", "get_time"):
            prepared = prepare_chat(rt, ChatRequest(QUESTION, settings, tools=FORCED, tool_choice=choice))
            outcome = list(stream_chat(rt, prepared))[-1]
            assert outcome.tool_calls and not outcome.invalid_tool_calls, outcome.raw
            assert fmt.at_start or any(m in outcome.raw for m in fmt.opens), outcome.raw
            for c in outcome.tool_calls:
                assert choice == "required" or c.name == "get_time"
                jsonschema.validate(c.arguments, SCHEMAS[c.name])
            calls = [(c.name, c.arguments) for c in outcome.tool_calls]
            seen.append({"choice": choice, "raw": outcome.raw[:300], "calls": calls})
        record.update(status="ok", runs=seen)
        print(f"{family}: {fmt.name} forced calls read back: {[r['calls'] for r in seen]}")
    finally:
        _write(record)
        rt.close()


def _write(record: dict[str, object]) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as f:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")
