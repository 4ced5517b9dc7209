"""Prometheus metrics of both services, scraped over HTTP after a scripted mix of calls: finished
completions (one with n = 2), a client cancel and an invalid request. Values are compared as deltas
(the in-process stack is shared with the tracing tests)."""

from __future__ import annotations

from collections import defaultdict

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tandem.v1 import generation_pb2_grpc as pb_grpc

from frontend_svc.client import generate_request
from tests.observability.support import Stack, scrape
from tests.support import wait_until

ENGINE_NAMES = ("tandem_num_requests_running", "tandem_num_requests_waiting", "tandem_kv_cache_usage_perc",
                "tandem_num_preemptions_total", "tandem_prefix_cache_queries_total",
                "tandem_prefix_cache_hits_total", "tandem_prompt_tokens_total", "tandem_generation_tokens_total",
                "tandem_iteration_tokens_count", "tandem_iteration_tokens_bucket")
FRONTEND_NAMES = ("tandem_request_success_total", "tandem_request_failure_total",
                  "tandem_time_to_first_token_seconds_count", "tandem_inter_token_latency_seconds_count",
                  "tandem_e2e_request_latency_seconds_count", "tandem_request_queue_time_seconds_count",
                  "tandem_request_prompt_tokens_sum", "tandem_request_generation_tokens_sum",
                  "tandem_engine_requests_total", "tandem_engine_ready", "tandem_engine_load")

Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


def samples(port: int) -> Samples:
    out: Samples = defaultdict(dict)
    for family in text_string_to_metric_families(scrape(port)):
        for s in family.samples:
            out[s.name][tuple(sorted(s.labels.items()))] = s.value
    return out


def total(data: Samples, name: str, **labels: str) -> float:
    return sum(v for key, v in data.get(name, {}).items() if set(labels.items()) <= set(key))


@pytest.fixture()
def mix(stack: Stack):  # type: ignore[no-untyped-def]
    """Run the scripted mix; return (engine before, engine after, frontend before, frontend after)."""
    eng0, fe0 = samples(stack.engine_metrics_port), samples(stack.frontend_metrics_port)
    tokens = 0
    with grpc.insecure_channel(f"127.0.0.1:{stack.frontend_port}") as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        for max_tokens, n in ((3, 1), (5, 1), (4, 2)):
            request = generate_request(token_ids=list(range(30, 50)), max_tokens=max_tokens, n=n,
                                       temperature=0.0 if n == 1 else 0.8, seed=1, ignore_eos=True)
            tokens += sum(len(r.token_ids) for r in stub.Generate(request, timeout=60))
        endless = stub.Generate(generate_request(token_ids=[7] * 10, max_tokens=200, ignore_eos=True), timeout=60)
        next(endless)
        endless.cancel()
        with pytest.raises(grpc.RpcError):
            list(stub.Generate(generate_request(token_ids=[1], top_p=2.0), timeout=60))
    assert tokens == 3 + 5 + 2 * 4

    def settled() -> bool:
        fe = samples(stack.frontend_metrics_port)
        calls = total(fe, "tandem_request_success_total") + total(fe, "tandem_request_failure_total")
        base = total(fe0, "tandem_request_success_total") + total(fe0, "tandem_request_failure_total")
        eng = samples(stack.engine_metrics_port)
        return calls - base == 5 and total(eng, "tandem_num_requests_running") == 0
    wait_until(settled, 20, "the gauges settled")
    return eng0, samples(stack.engine_metrics_port), fe0, samples(stack.frontend_metrics_port)


def test_every_metric_is_exported(mix) -> None:  # type: ignore[no-untyped-def]
    _, eng, _, fe = mix
    for name in ENGINE_NAMES:
        assert name in eng, name
    for name in FRONTEND_NAMES:
        assert name in fe, name
    assert all(dict(key)["model_name"] for key in fe["tandem_request_success_total"])
    assert all("engine" in dict(key) for key in fe["tandem_engine_requests_total"])


def test_counts_reconcile(mix) -> None:  # type: ignore[no-untyped-def]
    eng0, eng, fe0, fe = mix

    def d(after: Samples, before: Samples, name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert d(fe, fe0, "tandem_request_success_total", finished_reason="length") == 3
    assert d(fe, fe0, "tandem_request_failure_total", code="CANCELLED") == 1
    assert d(fe, fe0, "tandem_request_failure_total", code="INVALID_ARGUMENT") == 1
    assert d(fe, fe0, "tandem_request_success_total") + d(fe, fe0, "tandem_request_failure_total") == 5
    # TTFT for every call that produced a token (3 finished + the cancelled one); e2e for the finished.
    assert d(fe, fe0, "tandem_time_to_first_token_seconds_count") == 4
    assert d(fe, fe0, "tandem_e2e_request_latency_seconds_count") == 3
    # One queue time per engine request that was scheduled: 1 + 1 + 2 + the cancelled one.
    assert d(fe, fe0, "tandem_request_queue_time_seconds_count") == 5
    assert d(fe, fe0, "tandem_engine_requests_total") == 5
    # ITL: one per response after a completion's first: (3-1) + (5-1) + 2*(4-1) at most (steps may merge).
    assert 0 < d(fe, fe0, "tandem_inter_token_latency_seconds_count") <= 12
    assert d(fe, fe0, "tandem_request_generation_tokens_sum") == 3 + 5 + 8
    assert d(fe, fe0, "tandem_request_prompt_tokens_sum") == 3 * 20
    # The engine sampled at least what the finished calls received, plus the cancelled call's tokens.
    generated = d(eng, eng0, "tandem_generation_tokens_total")
    assert 3 + 5 + 8 + 1 <= generated <= 3 + 5 + 8 + 200
    assert d(eng, eng0, "tandem_iteration_tokens_count") >= 5
    # Every scheduled token is a computed prompt token or a fed-back sampled one; each of the 5 engine
    # requests' last sampled token is never fed back (holds without preemption, which recomputes).
    if d(eng, eng0, "tandem_num_preemptions_total") == 0:
        assert d(eng, eng0, "tandem_iteration_tokens_sum") == d(eng, eng0, "tandem_prompt_tokens_total") + generated - 5
    # The repeated 20-token prompt is served from the prefix cache after the first call.
    assert d(eng, eng0, "tandem_prefix_cache_hits_total") > 0
    assert d(eng, eng0, "tandem_prefix_cache_queries_total") >= d(eng, eng0, "tandem_prefix_cache_hits_total")
    assert total(eng, "tandem_num_requests_waiting") == 0
    assert 0 <= total(eng, "tandem_kv_cache_usage_perc") <= 1
