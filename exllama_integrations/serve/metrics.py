"""Prometheus ``/metrics`` for one server (``prometheus-client``; vLLM's names, with the ``exllama:`` prefix).

Requests in flight, finished and refused, tokens, prefix-cache reads, time-to-first-token, per-token and
whole-request latency histograms, whether the model takes requests (``exllama:healthy``) and how often its
engine processes were started again (``exllama:engine_restarts``).

Each app has a registry of its own (several servers may share a process, as the tests' do); a finished request
is observed once, where its usage is known (:func:`~.state.record`).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

router = APIRouter(tags=["server"])

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)


class Metrics:
    """The server's Prometheus metrics, in a registry of its own."""

    def __init__(self, model: str, in_flight: Any, healthy: Any = None, restarts: Any = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        reg, per_model = self.registry, ("model_name",)
        self.model = model
        self.in_flight = Gauge(
            "exllama:num_requests_running",
            "Requests in flight (decoding or queued).",
            labelnames=per_model,
            registry=reg,
        )
        self.in_flight.labels(model).set_function(in_flight)
        self.healthy = Gauge(
            "exllama:healthy",
            "1 while the model takes requests; 0 while it cannot (its engine process died or hung and is starting "
            "again, or waits out a back-off: /health says which).",
            labelnames=per_model,
            registry=reg,
        )
        self.healthy.labels(model).set_function(healthy or (lambda: 1))
        self.restarts = Gauge(
            "exllama:engine_restarts",
            "Engine processes started again after one died or hung (since the server started).",
            labelnames=per_model,
            registry=reg,
        )
        self.restarts.labels(model).set_function(restarts or (lambda: 0))
        self.finished = Counter(
            "exllama:request_success",
            "Requests finished, by finish reason.",
            labelnames=("model_name", "finished_reason"),
            registry=reg,
        )
        self.refused = Counter(
            "exllama:request_rejected",
            "Requests refused before running, by reason (busy: the in-flight limit).",
            labelnames=("model_name", "reason"),
            registry=reg,
        )
        self.prompt_tokens = Counter("exllama:prompt_tokens", "Prompt tokens read.", labelnames=per_model, registry=reg)
        self.generation_tokens = Counter(
            "exllama:generation_tokens", "Tokens generated.", labelnames=per_model, registry=reg
        )
        self.cached_tokens = Counter(
            "exllama:prefix_cache_hits",
            "Prompt tokens read from the prefix cache instead of computed.",
            labelnames=per_model,
            registry=reg,
        )
        self.ttft = Histogram(
            "exllama:time_to_first_token_seconds",
            "Time to first token.",
            buckets=LATENCY_BUCKETS,
            labelnames=per_model,
            registry=reg,
        )
        self.per_token = Histogram(
            "exllama:time_per_output_token_seconds",
            "Mean time between output tokens of a request, after the first.",
            buckets=PER_TOKEN_BUCKETS,
            labelnames=per_model,
            registry=reg,
        )
        self.latency = Histogram(
            "exllama:e2e_request_latency_seconds",
            "Whole-request latency.",
            buckets=LATENCY_BUCKETS,
            labelnames=per_model,
            registry=reg,
        )

    def observe(self, usage: Any, timings: Any, finish: str | None) -> None:
        """One finished request."""
        m = self.model
        self.finished.labels(m, finish or "unknown").inc()
        self.prompt_tokens.labels(m).inc(usage.prompt_tokens)
        self.generation_tokens.labels(m).inc(usage.completion_tokens)
        self.cached_tokens.labels(m).inc(usage.cached_tokens)
        if timings is None:
            return
        if timings.time_to_first_token is not None:
            self.ttft.labels(m).observe(timings.time_to_first_token)
            if usage.completion_tokens > 1:
                decode = max(timings.total - timings.time_to_first_token, 0.0)
                self.per_token.labels(m).observe(decode / (usage.completion_tokens - 1))
        self.latency.labels(m).observe(timings.total)

    def refuse(self, reason: str) -> None:
        """One request refused before it ran."""
        self.refused.labels(self.model, reason).inc()


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    """The server's metrics in Prometheus' text format."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    registry = request.app.state.serve.metrics.registry  # the ServeState the app was made with (a floor above)
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


__all__ = ["Metrics", "router"]
