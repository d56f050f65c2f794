"""Prometheus ``/metrics`` and the load report ``/v1/loads``: ours (``exllama:``), and the gateways' (``vllm:``).

Ours: requests in flight, finished and refused, tokens, prefix-cache reads, time-to-first-token, per-token and
whole-request latency histograms, whether the model takes requests (``exllama:healthy``), whether it is loaded
(``exllama:model_loaded``) and how often its engine processes were started again (``exllama:engine_restarts``).

Beside them, in vLLM's names, what the gateways people run in front of model servers read to route by load and
cache (the list is pinned against their sources in ``tests/integration/test_gateway_metrics.py``): requests decoding
(``vllm:num_requests_running``) and waiting (``vllm:num_requests_waiting``: queued, or waiting for their model to
load), the share of the KV cache that requests in flight hold (``vllm:kv_cache_usage_perc``, and its older name
``vllm:gpu_cache_usage_perc``), prefix-cache hits and queries in tokens (``vllm:prefix_cache_hits``,
``vllm:prefix_cache_queries``; their ratio as the older ``vllm:gpu_prefix_cache_hit_rate``) and the cache's shape
(``vllm:cache_config_info``; and ``vllm:lora_requests_info``, naming no adapter). ``/v1/loads`` is SGLang's load
report, which SMG asks every worker for first.

One registry per server (:class:`Families`); each model served adds its series, labelled ``model_name``
(:class:`Metrics`), so a server of several models exports one of each family. A finished request is observed
once, where its usage is known (:func:`~.state.record`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi.responses import Response

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)
BLOCK_SIZE = 256
"""The cache block (page) size reported in ``vllm:cache_config_info`` (exllamav3's page; the prefix router's block)."""

Reading = Callable[[], float]


class Families:
    """Every metric family of one server, in a registry of its own (several servers may share a process)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = reg = CollectorRegistry(auto_describe=True)
        self.models: dict[str, Metrics] = {}
        """Each model's series, by served name."""
        m = ("model_name",)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, labelnames=m, registry=reg)

        self.in_flight = gauge("exllama:num_requests_running", "Requests in flight (decoding or queued).")
        self.healthy = gauge(
            "exllama:healthy",
            "1 while the model takes requests; 0 while it cannot (its engine process died or hung and is starting "
            "again, or waits out a back-off: /health says which).",
        )
        self.loaded = gauge("exllama:model_loaded", "1 while the model is loaded, 0 while it is not (or loading).")
        self.restarts = gauge(
            "exllama:engine_restarts",
            "Engine processes started again after one died or hung (since the server started).",
        )
        self.kv_usage = gauge(
            "exllama:kv_cache_usage_perc",
            "Share of the KV cache (0-1) the requests in flight hold (prompt + max_new_tokens each).",
        )
        self.finished = Counter(
            "exllama:request_success",
            "Requests finished, by finish reason.",
            ("model_name", "finished_reason"),
            registry=reg,
        )
        self.refused = Counter(
            "exllama:request_rejected",
            "Requests refused before running, by reason (busy: the in-flight limit; no_room, load_failed: the model "
            "could not be loaded).",
            ("model_name", "reason"),
            registry=reg,
        )
        self.prompt_tokens = Counter("exllama:prompt_tokens", "Prompt tokens read.", m, registry=reg)
        self.generation_tokens = Counter("exllama:generation_tokens", "Tokens generated.", m, registry=reg)
        self.cached_tokens = Counter(
            "exllama:prefix_cache_hits",
            "Prompt tokens read from the prefix cache instead of computed.",
            m,
            registry=reg,
        )
        self.ttft = Histogram(
            "exllama:time_to_first_token_seconds", "Time to first token.", m, buckets=LATENCY_BUCKETS, registry=reg
        )
        self.per_token = Histogram(
            "exllama:time_per_output_token_seconds",
            "Mean time between output tokens of a request, after the first.",
            m,
            buckets=PER_TOKEN_BUCKETS,
            registry=reg,
        )
        self.latency = Histogram(
            "exllama:e2e_request_latency_seconds", "Whole-request latency.", m, buckets=LATENCY_BUCKETS, registry=reg
        )
        # vLLM's names, as the gateways read them
        self.vllm_running = gauge("vllm:num_requests_running", "Requests decoding (vLLM's name).")
        self.vllm_waiting = gauge(
            "vllm:num_requests_waiting", "Requests waiting: queued, or waiting for their model to load (vLLM's name)."
        )
        self.vllm_kv = gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0-1 (vLLM's name).")
        self.vllm_gpu_kv = gauge("vllm:gpu_cache_usage_perc", "KV-cache usage, 0-1 (vLLM's older name).")
        self.vllm_hit_rate = gauge(
            "vllm:gpu_prefix_cache_hit_rate", "Prefix-cache hits / queries in tokens since start (vLLM's older gauge)."
        )
        self.vllm_hits = Counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache (vLLM's name).", m, registry=reg
        )
        self.draft_accepted = Counter(
            "exllama:spec_decode_accepted_tokens",
            "Drafted tokens the model accepted (speculative decoding, MTP heads), over finished requests.",
            m,
            registry=reg,
        )
        self.draft_tokens = Counter(
            "exllama:spec_decode_draft_tokens",
            "Tokens drafted (accepted and rejected) for finished requests; accepted / drafted is the acceptance.",
            m,
            registry=reg,
        )
        self.vllm_queries = Counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache (vLLM's name).", m, registry=reg
        )
        self.cache_config = Gauge(
            "vllm:cache_config_info",
            "The KV cache's shape: block_size tokens per block, num_gpu_blocks blocks (vLLM's name; 1 per model).",
            ("model_name", "block_size", "num_gpu_blocks"),
            registry=reg,
        )
        lora = Gauge(
            "vllm:lora_requests_info",
            "LoRA adapters requests run and wait for (vLLM's name; none: an adapter here loads with its model).",
            ("max_lora", "running_lora_adapters", "waiting_lora_adapters"),
            registry=reg,
        )
        lora.labels("0", "", "").set_to_current_time()  # its value is when it was set, as vLLM's

    def exposition(self) -> bytes:
        """Every model's series in Prometheus' text format."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    def loads(self) -> dict[str, Any]:
        """SGLang's load report (what SMG reads first from a worker): one rank, the models served summed."""
        running = waiting = used = capacity = 0
        hits = queries = 0.0
        for model in self.models.values():
            running += int(model.running())
            waiting += int(model.waiting())
            u, c = model.cache_use()
            used, capacity = used + u, capacity + c
            hits += model.hits
            queries += model.queries
        usage = used / capacity if capacity else 0.0
        load = {
            "dp_rank": 0,
            "num_running_reqs": running,
            "num_waiting_reqs": waiting,
            "num_total_reqs": running + waiting,
            "num_used_tokens": used,
            "max_total_num_tokens": capacity,
            "token_usage": usage,
            "utilization": usage,
            "cache_hit_rate": hits / queries if queries else 0.0,
        }
        return {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "dp_rank_count": 1, "loads": [load]}


class Metrics:
    """One model's series in its server's families (``families``; a registry of its own by default)."""

    def __init__(
        self,
        model: str,
        in_flight: Reading,
        healthy: Reading | None = None,
        restarts: Reading | None = None,
        *,
        running: Reading | None = None,
        cache_use: Callable[[], tuple[int, int]] | None = None,
        loaded: Reading | None = None,
        families: Families | None = None,
    ) -> None:
        """The model's series, read from the functions given.

        ``in_flight``: requests in flight (decoding, queued, or waiting for the model to load); ``running``: those
        decoding (default: all of them); ``cache_use``: KV-cache tokens held and the cache's capacity (default: none).
        """
        f = self.families = families or Families()
        self.registry = f.registry
        self.model = model
        self.in_flight = in_flight
        self.running: Reading = running or in_flight
        self.cache_use: Callable[[], tuple[int, int]] = cache_use or (lambda: (0, 0))
        self.hits = self.queries = 0.0
        self._cache_labels: tuple[str, str] | None = None
        f.models[model] = self
        f.in_flight.labels(model).set_function(in_flight)
        f.healthy.labels(model).set_function(healthy or (lambda: 1))
        f.loaded.labels(model).set_function(loaded or (lambda: 1))
        f.restarts.labels(model).set_function(restarts or (lambda: 0))
        f.kv_usage.labels(model).set_function(self.kv_usage)
        f.vllm_running.labels(model).set_function(self.running)
        f.vllm_waiting.labels(model).set_function(self.waiting)
        f.vllm_kv.labels(model).set_function(self.kv_usage)
        f.vllm_gpu_kv.labels(model).set_function(self.kv_usage)
        f.vllm_hit_rate.labels(model).set_function(lambda: self.hits / self.queries if self.queries else 0.0)
        for family in (
            f.prompt_tokens,
            f.generation_tokens,
            f.cached_tokens,
            f.vllm_hits,
            f.vllm_queries,
            f.draft_accepted,
            f.draft_tokens,
        ):
            family.labels(model)  # present (at 0) before the first request, as gateways expect

    def waiting(self) -> float:
        """Requests in flight that are not decoding."""
        return max(0.0, float(self.in_flight()) - float(self.running()))

    def kv_usage(self) -> float:
        """The share of the KV cache the requests in flight hold (0 where the runtime does not say)."""
        used, capacity = self.cache_use()
        return min(1.0, used / capacity) if capacity else 0.0

    def cache_shape(self, capacity_tokens: int) -> None:
        """The loaded model's cache holds ``capacity_tokens`` (``vllm:cache_config_info``; 0: none loaded)."""
        labels = (str(BLOCK_SIZE), str(capacity_tokens // BLOCK_SIZE)) if capacity_tokens else None
        if labels == self._cache_labels:
            return
        if self._cache_labels is not None:
            self.families.cache_config.remove(self.model, *self._cache_labels)
        self._cache_labels = labels
        if labels is not None:
            self.families.cache_config.labels(self.model, *labels).set(1)

    def observe(self, usage: Any, timings: Any, finish: str | None) -> None:
        """One finished request."""
        f, m = self.families, self.model
        f.finished.labels(m, finish or "unknown").inc()
        f.prompt_tokens.labels(m).inc(usage.prompt_tokens)
        f.generation_tokens.labels(m).inc(usage.completion_tokens)
        f.cached_tokens.labels(m).inc(usage.cached_tokens)
        f.draft_accepted.labels(m).inc(usage.accepted_draft_tokens)
        f.draft_tokens.labels(m).inc(usage.accepted_draft_tokens + usage.rejected_draft_tokens)
        f.vllm_hits.labels(m).inc(usage.cached_tokens)
        f.vllm_queries.labels(m).inc(usage.prompt_tokens)
        self.hits += usage.cached_tokens
        self.queries += usage.prompt_tokens
        if timings is None:
            return
        if timings.time_to_first_token is not None:
            f.ttft.labels(m).observe(timings.time_to_first_token)
            if usage.completion_tokens > 1:
                decode = max(timings.total - timings.time_to_first_token, 0.0)
                f.per_token.labels(m).observe(decode / (usage.completion_tokens - 1))
        f.latency.labels(m).observe(timings.total)

    def refuse(self, reason: str) -> None:
        """One request refused before it ran."""
        self.families.refused.labels(self.model, reason).inc()


def exposition_response(families: Families) -> Response:
    """``/metrics``' answer."""
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(families.exposition(), media_type=CONTENT_TYPE_LATEST)


__all__ = ["Families", "Metrics", "exposition_response"]
