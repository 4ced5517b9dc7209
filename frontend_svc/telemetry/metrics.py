"""Frontend Prometheus metrics (`prometheus-client`, one CollectorRegistry per FrontendMetrics).

Per Generate call (a "request"): exactly one of `tandem_request_success_total{finished_reason}` (the
call's stream ended normally; the reason of completion 0) or `tandem_request_failure_total{code}` (it
ended with a gRPC status: invalid input, overload, cancel, deadline, engine error). So success + failure
= calls, and `tandem_time_to_first_token_seconds_count` = calls that produced at least one token.
Latencies use this process's monotonic clock from the call's arrival; the queue time is the engine's
first SCHEDULED minus its QUEUED event timestamp (both engine-side, from the engine's output events).
Per-engine series carry an `engine` label (the engine's address).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from frontend_svc.output_processor import ProcessedOutputs

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 10.0)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class FrontendMetrics:
    """The frontend's series, bound to one model name. Methods run on the asyncio loop."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self.registry = registry or CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.success = Counter("tandem_request_success", "Generate calls that finished, by the finish reason "
                               "of completion 0", ["model_name", "finished_reason"], registry=r)
        self.failure = Counter("tandem_request_failure", "Generate calls that ended with a gRPC error status",
                               ["model_name", "code"], registry=r)
        self.ttft = Histogram("tandem_time_to_first_token_seconds", "Call arrival to its first token",
                              m, buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("tandem_inter_token_latency_seconds", "Time between two responses of one "
                             "completion", m, buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("tandem_e2e_request_latency_seconds", "Call arrival to its last response",
                             m, buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self.queue_time = Histogram("tandem_request_queue_time_seconds", "Time an engine request waited "
                                    "before its first schedule (engine clock)", m, buckets=LATENCY_BUCKETS,
                                    registry=r).labels(model_name)
        self.prompt_tokens = Histogram("tandem_request_prompt_tokens", "Prompt tokens per finished call", m,
                                       buckets=TOKEN_BUCKETS, registry=r).labels(model_name)
        self.generation_tokens = Histogram("tandem_request_generation_tokens", "Generated tokens per finished "
                                           "call (all completions)", m, buckets=TOKEN_BUCKETS,
                                           registry=r).labels(model_name)
        self.migrations = Counter("tandem_request_migrations", "Requests moved to another engine because "
                                  "theirs died or handed them back (reason engine_lost | handed_back; outcome "
                                  "moved, or failed when they could not move and ended with UNAVAILABLE)",
                                  ["model_name", "reason", "outcome"], registry=r)
        self.engine_requests = Counter("tandem_engine_requests", "Engine requests (completions) routed to "
                                       "each engine", ["model_name", "engine"], registry=r)

    def watch_engines(self, connections: Callable[[], Iterable[Any]]) -> None:
        """Export per-engine gauges, read at scrape time from `connections()` (EngineConnection-like)."""
        self.registry.register(_EngineCollector(self.model_name, connections))

    def observe_step(self, processed: ProcessedOutputs) -> None:
        """What one engine message's processing handed out: its requests' queue times (engine clock)."""
        for seconds in processed.queue_times:
            self.queue_time.observe(seconds)


class _EngineCollector(Collector):
    def __init__(self, model_name: str, connections: Callable[[], Iterable[Any]]) -> None:
        self._model_name = model_name
        self._connections = connections

    def collect(self) -> Iterable[GaugeMetricFamily]:
        labels = ["model_name", "engine"]
        ready = GaugeMetricFamily("tandem_engine_ready", "1 while the engine is routable", labels=labels)
        load = GaugeMetricFamily("tandem_engine_load", "The router's load estimate (running + waiting)",
                                 labels=labels)
        in_flight = GaugeMetricFamily("tandem_engine_requests_in_flight", "This frontend's unfinished "
                                      "engine requests on the engine", labels=labels)
        cached = GaugeMetricFamily("tandem_engine_cached_blocks", "KV blocks the engine has cached, as this "
                                   "frontend's index follows them (cache-aware routing; 0 otherwise)", labels=labels)
        for c in self._connections():
            key = [self._model_name, c.address]
            ready.add_metric(key, 1.0 if c.ready else 0.0)
            load.add_metric(key, float(c.load))
            in_flight.add_metric(key, float(c.num_in_flight))
            cached.add_metric(key, float(len(c.kv_index)))
        return [ready, load, in_flight, cached]
