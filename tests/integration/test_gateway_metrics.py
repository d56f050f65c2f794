"""What the gateways people put in front of model servers read from a worker, read from ours.

The names below were read from the gateways' own sources (the search tool's copies, at the commits named), and a
real server on the demo model is scraped by prometheus-client's parser: every name is there, per model
(``model_name``), and says what it means while a request runs and at rest. ``/v1/loads`` is read as SMG reads it.
"""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from servers import ThreadServer

SMG_READS = {
    # smg-project/smg@f8daa8835, model_gateway/src/worker/monitor.rs, fetch_http_load_vllm: a vLLM worker's load
    # (the KV-usage gauge is required, under either name)
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:gpu_cache_usage_perc",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_prefix_cache_hit_rate",
}
LLM_D_READS = {
    # llm-d/llm-d-inference-scheduler@520af478, pkg/epp/framework/plugins/datalayer/extractor/metrics/factories.go,
    # defaultEngineConfigs["vllm"] (also pkg/epp/server/options.go)
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:lora_requests_info",
    "vllm:cache_config_info",
}
ISSUE_NAMES = {"vllm:prefix_cache_hits", "vllm:prefix_cache_queries"}  # vLLM v1's counters (prefix-cache hit rate)
SMG_LOAD_FIELDS = {
    # smg-project/smg@f8daa8835, crates/protocols/src/worker.rs, SchedulerLoadSnapshot: what GET /v1/loads must hold
    "dp_rank": int,
    "num_running_reqs": int,
    "num_waiting_reqs": int,
    "num_total_reqs": int,
    "num_used_tokens": int,
    "max_total_num_tokens": int,
    "token_usage": float,
    "cache_hit_rate": float,
    "utilization": float,
}


def scrape(url: str) -> dict[str, list]:
    r = httpx.get(url + "/metrics", timeout=30)
    assert r.status_code == 200
    return {f.name: f.samples for f in text_string_to_metric_families(r.text)}


def value(samples: dict[str, list], name: str, model: str) -> float:
    [v] = [s.value for s in samples[name] if s.labels.get("model_name") == model and not s.name.endswith("_created")]
    return v


@pytest.fixture(scope="module")
def server(demo_runtime):
    s = ThreadServer(demo_runtime, served_model_name="smol")
    yield s
    s.stop()


def test_every_name_the_gateways_read_is_exported_per_model(server):
    prompt = {"model": "smol", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    usages = [httpx.post(server.url + "/v1/completions", json=prompt, timeout=60).json()["usage"] for _ in range(2)]
    m = scrape(server.url)
    # prometheus-client's parser names a counter's family without its _total (vLLM's counters read the same way)
    for name in sorted(SMG_READS | LLM_D_READS | ISSUE_NAMES):
        assert name in m, f"{name} is not exported"
        if name != "vllm:lora_requests_info":
            assert any(s.labels.get("model_name") == "smol" for s in m[name]), f"{name} has no model_name label"
    assert value(m, "vllm:num_requests_running", "smol") == 0 and value(m, "vllm:num_requests_waiting", "smol") == 0
    assert value(m, "vllm:kv_cache_usage_perc", "smol") == 0 == value(m, "vllm:gpu_cache_usage_perc", "smol")
    queries = value(m, "vllm:prefix_cache_queries", "smol")
    hits = value(m, "vllm:prefix_cache_hits", "smol")
    assert queries == sum(u["prompt_tokens"] for u in usages)
    assert hits == sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert value(m, "vllm:gpu_prefix_cache_hit_rate", "smol") == pytest.approx(hits / queries)
    [info] = m["vllm:cache_config_info"]
    context = server.app.state.serve.info.context_length
    assert info.labels["block_size"] == "256" and int(info.labels["num_gpu_blocks"]) == context // 256


def test_a_request_in_flight_is_running_and_holds_cache_in_both_reports(server):
    body = {"model": "smol", "prompt": "Tell me a story.", "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        m = scrape(server.url)
        loads = httpx.get(server.url + "/v1/loads?include=core,disagg,queues,memory", timeout=30).json()
    assert value(m, "vllm:num_requests_running", "smol") == 1
    assert value(m, "exllama:num_requests_running", "smol") == 1
    usage = value(m, "vllm:kv_cache_usage_perc", "smol")
    assert 0 < usage < 1 and usage == value(m, "vllm:gpu_cache_usage_perc", "smol")
    assert loads["dp_rank_count"] == 1 and len(loads["loads"]) == 1
    [load] = loads["loads"]
    for field, kind in SMG_LOAD_FIELDS.items():
        assert isinstance(load[field], kind), (field, load[field])
    assert load["num_running_reqs"] == 1 and load["num_waiting_reqs"] == 0
    assert load["num_used_tokens"] >= 300 and load["max_total_num_tokens"] == server.app.state.serve.info.context_length
    assert load["token_usage"] == pytest.approx(load["num_used_tokens"] / load["max_total_num_tokens"])
