"""Engine Prometheus metrics (`prometheus-client`, one CollectorRegistry per EngineMetrics).

Two sources, so nothing is counted twice:
- Read at scrape time from the latest `SchedulerStats` (the busy loop publishes it after each step):
  the gauges `tandem_num_requests_running`, `tandem_num_requests_waiting`, `tandem_kv_cache_usage_perc`
  (also under vLLM's names, `vllm:...`, with `vllm:cache_config_info`, for schedulers that read those)
  and the counters the scheduler already keeps cumulatively — `tandem_num_preemptions_total`,
  `tandem_prefix_cache_queries_total`, `tandem_prefix_cache_hits_total` (in tokens) and speculative
  decoding's `tandem_spec_decode_num_drafts_total`, `_num_draft_tokens_total`, `_num_accepted_tokens_total`
  and `_num_accepted_tokens_per_pos_total{position}` (vLLM's `vllm:spec_decode_*`) — exported as is.
- Read at scrape time from the KV event publisher (engine_svc/api/kv_events.py), when events are on:
  `tandem_kv_cache_events_sent_total` (blocks stored or removed, and clears, written to subscribers,
  snapshots included), `tandem_kv_cache_events_dropped_total` (events dropped subscribers never got),
  `tandem_kv_cache_event_subscribers_dropped_total` (subscribers dropped for falling too far behind) and
  the gauge `tandem_kv_cache_event_subscribers`.
- With --enable-lora, read at scrape time from the latest `SchedulerStats` too: vLLM's LoRA info gauge as
  `tandem_lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}` (value: the scrape's
  time; the adapters of the running / waiting requests, comma-separated).
- Accumulated per step by `record_step` (called on the busy-loop thread; a few additions, no I/O):
  the per-step figures `tandem_prompt_tokens_total`, `tandem_generation_tokens_total` and the
  histogram `tandem_iteration_tokens` (tokens scheduled per step that ran something).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine_svc.api.kv_events import KvEventPublisher
from shared_runtime.contract import SchedulerStats

ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self.registry = registry or CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.prompt_tokens = Counter("tandem_prompt_tokens", "Prompt tokens computed (prefix-cache hits "
                                     "excluded)", m, registry=r).labels(model_name)
        self.generation_tokens = Counter("tandem_generation_tokens", "Tokens sampled", m,
                                         registry=r).labels(model_name)
        self.iteration_tokens = Histogram("tandem_iteration_tokens", "Tokens scheduled per engine step", m,
                                          buckets=ITERATION_TOKEN_BUCKETS, registry=r).labels(model_name)

    def track(self, latest_stats: Callable[[], SchedulerStats], cache_config: Mapping[str, str] | None = None) -> None:
        """Export the gauges and cumulative counters of `latest_stats()` at every scrape, and vLLM's names
        of the load gauges (with `cache_config`'s labels on `vllm:cache_config_info`)."""
        self.registry.register(_StatsCollector(self.model_name, latest_stats))
        self.registry.register(_VllmGauges(self.model_name, latest_stats, dict(cache_config or {})))

    def track_lora(self, max_loras: int, latest_stats: Callable[[], SchedulerStats]) -> None:
        """Export vLLM's LoRA info gauge (as `tandem_lora_requests_info`) at every scrape (--enable-lora)."""
        self.registry.register(_LoRACollector(max_loras, latest_stats))

    def track_kv_events(self, publisher: KvEventPublisher) -> None:
        """Export the KV event publisher's counters at every scrape."""
        self.registry.register(_KvEventsCollector(self.model_name, publisher))

    def record_step(self, stats: SchedulerStats | None) -> None:
        """One step's per-step figures (busy-loop thread)."""
        if stats is None or not stats.num_scheduled_tokens:
            return
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        self.iteration_tokens.observe(stats.num_scheduled_tokens)


# The load gauges, exported under tandem's prefix and under vLLM's (`vllm:`, for schedulers that read
# vLLM's names): (name after the prefix, help, the SchedulerStats field).
_LOAD_GAUGES = (
    ("num_requests_running", "Requests in the running batch", "num_running"),
    ("num_requests_waiting", "Requests waiting to be scheduled", "num_waiting"),
    ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)", "kv_cache_usage"),
)


def _load_gauges(prefix: str, names: list[str], labels: list[str], s: SchedulerStats) -> list[Metric]:
    out: list[Metric] = []
    for name, doc, field in _LOAD_GAUGES:
        gauge = GaugeMetricFamily(prefix + name, doc, labels=names)
        gauge.add_metric(labels, float(getattr(s, field)))
        out.append(gauge)
    return out


class _StatsCollector(Collector):
    def __init__(self, model_name: str, latest_stats: Callable[[], SchedulerStats]) -> None:
        self._labels = [model_name]
        self._latest = latest_stats

    def collect(self) -> Iterable[Metric]:
        s = self._latest()
        names = ["model_name"]
        out = _load_gauges("tandem_", names, self._labels, s)
        for name, doc, value in (
            ("tandem_num_preemptions", "Preemptions (recompute)", s.num_preemptions),
            ("tandem_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", s.prefix_cache_queries),
            ("tandem_prefix_cache_hits", "Prompt tokens found in the prefix cache", s.prefix_cache_hits),
        ):
            counter = CounterMetricFamily(name, doc, labels=names)
            counter.add_metric(self._labels, float(value))
            out.append(counter)
        out.extend(_spec_decode_counters(self._labels, s))
        return out


def _spec_decode_counters(labels: list[str], s: SchedulerStats) -> list[Metric]:
    """vLLM's `vllm:spec_decode_*` counters under tandem's prefix (zero without --speculative-config)."""
    out: list[Metric] = []
    for name, doc, value in (
        ("tandem_spec_decode_num_drafts", "Speculative verifications (one request's drafts in one step)",
         s.spec_decode_num_drafts),
        ("tandem_spec_decode_num_draft_tokens", "Draft tokens verified", s.spec_decode_num_draft_tokens),
        ("tandem_spec_decode_num_accepted_tokens", "Draft tokens accepted", s.spec_decode_num_accepted_tokens),
    ):
        counter = CounterMetricFamily(name, doc, labels=["model_name"])
        counter.add_metric(labels, float(value))
        out.append(counter)
    per_pos = CounterMetricFamily("tandem_spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted, by position in the draft", labels=["model_name", "position"])
    for position, value in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
        per_pos.add_metric([*labels, str(position)], float(value))
    out.append(per_pos)
    return out


class _VllmGauges(Collector):
    """vLLM's names for the gauges an external scheduler reads from an engine (llm-d's endpoint picker:
    queue depth, running batch, KV usage, and the cache's shape from `vllm:cache_config_info`'s labels),
    with vLLM's labels (`model_name`, `engine`), beside tandem's own. `vllm:cache_config_info` appears once
    the engine knows its block count (after its first step)."""

    def __init__(self, model_name: str, latest_stats: Callable[[], SchedulerStats], cache_config: dict[str, str]) -> None:
        self._labels = [model_name, "0"]
        self._latest = latest_stats
        self._cache_config = cache_config

    def collect(self) -> Iterable[Metric]:
        s = self._latest()
        names = ["model_name", "engine"]
        out = _load_gauges("vllm:", names, self._labels, s)
        if s.num_total_blocks:
            info = {**self._cache_config, "num_gpu_blocks": str(s.num_total_blocks)}
            gauge = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache (its labels)",
                                      labels=[*names, *info])
            gauge.add_metric([*self._labels, *info.values()], 1.0)
            out.append(gauge)
        return out


class _LoRACollector(Collector):
    """vLLM's `vllm:lora_requests_info`: one series whose labels name the adapters of the running and the
    waiting requests (comma-separated, sorted) and --max-loras; its value is the time of the scrape."""

    def __init__(self, max_loras: int, latest_stats: Callable[[], SchedulerStats]) -> None:
        self._max_lora = str(max_loras)
        self._latest = latest_stats

    def collect(self) -> Iterable[Metric]:
        s = self._latest()
        gauge = GaugeMetricFamily("tandem_lora_requests_info", "Running stats on LoRA requests",
                                  labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        gauge.add_metric([self._max_lora, ",".join(sorted(s.running_lora_adapters)),
                          ",".join(sorted(s.waiting_lora_adapters))], time.time())
        return [gauge]


class _KvEventsCollector(Collector):
    def __init__(self, model_name: str, publisher: KvEventPublisher) -> None:
        self._labels = [model_name]
        self._publisher = publisher

    def collect(self) -> Iterable[Metric]:
        counters = self._publisher.counters
        out: list[Metric] = []
        for name, doc, value in (
            ("tandem_kv_cache_events_sent", "KV cache events (blocks stored or removed, clears) written to "
             "SubscribeKvEvents subscribers, snapshots included", counters.sent_events),
            ("tandem_kv_cache_events_dropped", "KV cache events that dropped subscribers never got",
             counters.dropped_events),
            ("tandem_kv_cache_event_subscribers_dropped", "KV event subscribers dropped for falling too far "
             "behind", counters.dropped_subscribers),
        ):
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric(self._labels, float(value))
            out.append(counter)
        gauge = GaugeMetricFamily("tandem_kv_cache_event_subscribers", "Open SubscribeKvEvents streams",
                                  labels=["model_name"])
        gauge.add_metric(self._labels, float(self._publisher.num_subscribers))
        out.append(gauge)
        return out
