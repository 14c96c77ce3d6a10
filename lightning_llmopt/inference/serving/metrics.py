"""Prometheus metrics of the server (``GET /metrics``), in a registry of their own per server.

==========================================  =========  ==============================================================
name                                        type       meaning
==========================================  =========  ==============================================================
``llmopt_requests_running``                 gauge      requests in flight (queued in the engine or running)
``llmopt_requests_waiting``                 gauge      sequences waiting for admission in the scheduler
``llmopt_kv_blocks_total``                  gauge      KV blocks of the pool (the null block excluded)
``llmopt_kv_blocks_free``                   gauge      KV blocks free, or held only by the prefix cache (evictable)
``llmopt_engine_ready``                     gauge      1 once the engine is built
``llmopt_requests_total``                   counter    finished choices, by ``finish_reason`` (stop/length/abort)
``llmopt_requests_rejected_total``          counter    refused requests, by ``reason`` (invalid/unauthorized/...)
``llmopt_prompt_tokens_total``              counter    prompt tokens of finished requests
``llmopt_prompt_cached_tokens_total``       counter    of which served from the prefix cache
``llmopt_generation_tokens_total``          counter    generated tokens (all choices)
``llmopt_engine_steps_total``               counter    engine steps
``llmopt_engine_step_seconds``              histogram  duration of one engine step
``llmopt_time_to_first_token_seconds``      histogram  from the request's arrival to its first token
``llmopt_inter_token_latency_seconds``      histogram  between two streamed events of one choice, per token
``llmopt_e2e_request_latency_seconds``      histogram  from arrival to the last token
==========================================  =========  ==============================================================

A request whose client goes away is cancelled and still counted, once: its unfinished choices with
``finish_reason="abort"``, its prompt and the tokens generated until the cancel, its latency up to the disconnect.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ServerMetrics"]

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """The metrics above over one ``prometheus_client.CollectorRegistry``.

    Arguments:
        engine_state: returns ``(engine or None, requests in flight)`` for the gauges, read at scrape time.
    """

    def __init__(self, engine_state: Any) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self._state = engine_state
        Gauge("llmopt_requests_running", "requests in flight", registry=r).set_function(lambda: self._state()[1])
        Gauge("llmopt_requests_waiting", "sequences waiting for admission", registry=r).set_function(self._waiting)
        Gauge("llmopt_kv_blocks_total", "KV blocks of the pool", registry=r).set_function(self._blocks_total)
        Gauge("llmopt_kv_blocks_free", "KV blocks free or evictable", registry=r).set_function(self._blocks_free)
        Gauge("llmopt_engine_ready", "1 once the engine is built", registry=r).set_function(
            lambda: float(self._state()[0] is not None)
        )
        self.requests = Counter("llmopt_requests", "finished requests", ["finish_reason"], registry=r)
        self.rejected = Counter("llmopt_requests_rejected", "refused requests", ["reason"], registry=r)
        self.prompt_tokens = Counter("llmopt_prompt_tokens", "prompt tokens", registry=r)
        self.cached_tokens = Counter("llmopt_prompt_cached_tokens", "prompt tokens from the prefix cache", registry=r)
        self.generation_tokens = Counter("llmopt_generation_tokens", "generated tokens", registry=r)
        self.steps = Counter("llmopt_engine_steps", "engine steps", registry=r)
        self.step_seconds = Histogram("llmopt_engine_step_seconds", "engine step", buckets=_LATENCY, registry=r)
        self.ttft = Histogram("llmopt_time_to_first_token_seconds", "time to first token", buckets=_LATENCY, registry=r)
        self.itl = Histogram("llmopt_inter_token_latency_seconds", "inter-token latency", buckets=_LATENCY, registry=r)
        self.e2e = Histogram("llmopt_e2e_request_latency_seconds", "request latency", buckets=_LATENCY, registry=r)

    def _waiting(self) -> float:
        engine = self._state()[0]
        return float(len(engine.scheduler.waiting)) if engine is not None else 0.0

    def _blocks_total(self) -> float:
        engine = self._state()[0]
        return float(engine.blocks.allocator.capacity) if engine is not None else 0.0

    def _blocks_free(self) -> float:
        engine = self._state()[0]
        return float(engine.blocks.num_available()) if engine is not None else 0.0

    def on_step(self, engine: Any, events: list[Any], seconds: float) -> None:
        """Called by the engine loop after each step."""
        self.steps.inc()
        self.step_seconds.observe(seconds)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
