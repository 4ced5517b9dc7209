"""vLLM's LoRA info gauge as `tandem_lora_requests_info`: the scheduler counts the running and waiting
requests per adapter (base-model requests left out), the stats survive the wire, and the gauge's labels
name them with --max-loras."""

from __future__ import annotations

import prometheus_client

from engine_svc.telemetry.metrics import EngineMetrics
from shared_runtime.from_pb import stats_from_pb
from shared_runtime.to_pb import stats_to_pb
from tests.engine.test_lora_scheduling import add, drain, sched


def test_running_and_waiting_adapters_are_counted_and_exported() -> None:
    s = sched(max_loras=1)
    for rid, lora in (("r1", "a"), ("r2", "a"), ("r3", "b"), ("r4", ""), ("r5", "c")):
        add(s, rid, lora)
    s.schedule()  # one adapter place: a's two requests and the base one run; b and c wait
    stats = s.get_stats()
    assert stats.running_lora_adapters == {"a": 2} and stats.waiting_lora_adapters == {"b": 1, "c": 1}
    assert stats_from_pb(stats_to_pb(stats)) == stats
    metrics = EngineMetrics("tiny")
    metrics.track_lora(1, lambda: stats)
    text = prometheus_client.generate_latest(metrics.registry).decode()
    assert 'tandem_lora_requests_info{max_lora="1",running_lora_adapters="a",waiting_lora_adapters="b,c"}' in text
    drain(s)


def test_without_lora_no_adapter_is_counted() -> None:
    s = sched(lora_ids=None)
    add(s, "r1")
    s.schedule()
    stats = s.get_stats()
    assert stats.running_lora_adapters == {} == stats.waiting_lora_adapters
