"""SIGTERM to an engine behind two frontends (the session's `cluster`): a graceful drain.

Readiness ("" and the service name) turns NOT_SERVING at once while liveness stays SERVING; the
frontends stop routing to the engine; its in-flight requests finish; it exits 0 before the grace
period ends. Which engine admitted new requests is read from `GetLoad`'s `prefix_cache_queries`.
"""

from __future__ import annotations

import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from grpc_health.v1 import health_pb2
from tandem.v1 import generation_pb2 as pb

from frontend_svc.client import collect
from tests.support import DeadlineClient

pytestmark = pytest.mark.slow

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
ENGINE_SERVICE = "tandem.engine.v1.EngineCoreService"
LONG_TOKENS = 120


def test_sigterm_drains_an_engine_and_the_frontends_route_around_it(cluster: Any) -> None:
    cluster.heal()
    engine = cluster.engines[0]
    rng = random.Random(7)
    vocab = cluster.model_info(cluster.frontends[0]).vocab_size
    long_prompts = [[rng.randrange(3, vocab) for _ in range(20)] for _ in range(6)]
    with DeadlineClient(cluster.frontends[0].address) as c0, DeadlineClient(cluster.frontends[1].address) as c1:
        clients = [c0, c1]
        streams = [clients[i % 2].generate(token_ids=p, temperature=0, max_tokens=LONG_TOKENS, ignore_eos=True)
                   for i, p in enumerate(long_prompts)]
        firsts = [next(s) for s in streams]
        cluster.wait_until(lambda: sum(cluster.load(i).num_running for i in (0, 1)) == 6, what="6 running")
        assert cluster.load(0).num_running > 0

        sent = time.monotonic()
        engine.proc.send_signal(signal.SIGTERM)
        cluster.wait_until(lambda: cluster.health(engine.address, ENGINE_SERVICE) == NOT_SERVING, timeout=2.0,
                           what="engine readiness NOT_SERVING")
        assert cluster.health(engine.address, "") == NOT_SERVING
        assert cluster.health(engine.address, "liveness") == SERVING
        cluster.wait_frontends_see(1, timeout=5.0)
        assert cluster.load(0).num_running > 0, "the drain must still be running the old requests"

        admitted_before = cluster.load(0).prefix_cache_queries
        with ThreadPoolExecutor(6) as pool:
            new = list(pool.map(lambda i: collect(clients[i % 2].generate("drain " + str(i), max_tokens=3))[0],
                                range(6)))
        assert [r["finish_reason"] for r in new] == [pb.FINISH_REASON_LENGTH] * 6
        assert cluster.load(0).prefix_cache_queries == admitted_before, "a draining engine admitted a request"

        for first, stream in zip(firsts, streams):
            rest = collect(stream)[0]
            assert len(first.token_ids) + len(rest["token_ids"]) == LONG_TOKENS
            assert rest["finish_reason"] == pb.FINISH_REASON_LENGTH
    assert engine.proc.wait(cluster.drain_grace_s) == 0
    assert time.monotonic() - sent < cluster.drain_grace_s
    cluster.heal()
