"""Several engines behind several frontends, over real processes (the session's `cluster`).

Which engine served a request is read from the engines themselves: `GetLoad`'s `prefix_cache_queries`
grows by a request's prompt length when the engine admits it (and never otherwise, without
preemption, which the roomy KV cache rules out), so with equal-length prompts the growth of each
engine's counter divided by the prompt length is the number of requests it served.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from tandem.v1 import generation_pb2 as pb

from frontend_svc.client import collect
from tests.support import DeadlineClient

pytestmark = pytest.mark.slow

PROMPT_LEN = 24
LONG_TOKENS = 120  # long enough to still be running when an engine is killed (seconds on CPU)


@pytest.fixture()
def healthy(cluster: Any) -> Any:
    cluster.heal()
    return cluster


@pytest.fixture()
def clients(healthy: Any) -> Iterator[list[DeadlineClient]]:
    opened = [DeadlineClient(f.address) for f in healthy.frontends]
    try:
        yield opened
    finally:
        for client in opened:
            client.close()


def prompts(count: int, seed: int, vocab_size: int, length: int = PROMPT_LEN) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for _ in range(count)]


def queries(cluster: Any) -> list[int]:
    return [cluster.load(i).prefix_cache_queries for i in range(len(cluster.engines))]


def served_since(cluster: Any, before: list[int], prompt_len: int = PROMPT_LEN) -> list[int]:
    """Requests each engine admitted since `before` (exact multiples of the prompt length)."""
    grown = [after - b for after, b in zip(queries(cluster), before)]
    assert all(g % prompt_len == 0 for g in grown), f"counters grew by {grown}: preempted or stray requests?"
    return [g // prompt_len for g in grown]


def run_all(clients: list[DeadlineClient], prompt_ids: list[list[int]], **params: Any) -> list[dict[str, Any]]:
    """Every prompt at once, alternating frontends; the collected index-0 completions, in order."""
    def one(i: int) -> dict[str, Any]:
        return collect(clients[i % len(clients)].generate(token_ids=prompt_ids[i], **params))[0]

    with ThreadPoolExecutor(len(prompt_ids)) as pool:
        return list(pool.map(one, range(len(prompt_ids))))


def outcome(stream: Any) -> dict[str, Any] | grpc.StatusCode:
    try:
        return collect(stream)[0]
    except grpc.RpcError as error:
        return error.code()  # type: ignore[no-any-return]


def test_least_load_spreads_concurrent_requests_over_both_engines(healthy: Any,
                                                                  clients: list[DeadlineClient]) -> None:
    vocab = healthy.model_info(healthy.frontends[0]).vocab_size
    before = queries(healthy)
    results = run_all(clients, prompts(40, seed=1, vocab_size=vocab), temperature=0, max_tokens=8,
                      ignore_eos=True)
    assert [len(r["token_ids"]) for r in results] == [8] * 40
    served = served_since(healthy, before)
    assert sum(served) == 40
    assert max(served) <= 28, f"one engine took more than 70% of the requests: {served}"


def test_prefix_routing_keeps_a_shared_prefix_on_one_engine(healthy: Any) -> None:
    vocab = healthy.model_info(healthy.frontends[0]).vocab_size
    prefix = prompts(1, seed=2, vocab_size=vocab, length=80)[0]  # 5 full blocks of 16
    suffixes = prompts(8, seed=3, vocab_size=vocab, length=6)
    frontend = healthy.start_frontend("--routing", "prefix")
    try:
        frontend.wait_serving()
        healthy.wait_frontends_see(2, [frontend])
        before = queries(healthy)
        with DeadlineClient(frontend.address) as client:
            usages = [collect(client.generate(token_ids=prefix + s, temperature=0, max_tokens=2))[0]["usage"]
                      for s in suffixes]
    finally:
        frontend.stop()
    served = served_since(healthy, before, prompt_len=86)
    assert sorted(served) == [0, 8], f"prompts sharing a prefix went to several engines: {served}"
    assert [u.cached_prompt_tokens for u in usages] == [0] + [80] * 7


def test_killing_an_engine_moves_its_requests_and_a_restart_rejoins(healthy: Any,
                                                                    clients: list[DeadlineClient]) -> None:
    """The killed engine's streams go on on the survivor (request migration, tests/e2e/test_migration.py
    checks their outputs token for token); the others never notice."""
    vocab = healthy.model_info(healthy.frontends[0]).vocab_size
    long = dict(temperature=0, max_tokens=LONG_TOKENS, ignore_eos=True)
    streams = [clients[i % 2].generate(token_ids=p, **long) for i, p in enumerate(prompts(8, 4, vocab))]
    firsts = [next(s) for s in streams]  # all 8 admitted and streaming
    healthy.wait_until(lambda: sum(healthy.load(i).num_running for i in (0, 1)) == 8, what="8 running")
    on_killed = healthy.load(0).num_running
    assert 0 < on_killed < 8
    healthy.engines[0].kill()
    with ThreadPoolExecutor(len(streams)) as pool:
        outcomes = list(pool.map(outcome, streams))
    failed = [o for o in outcomes if not isinstance(o, dict)]
    finished = [(f, o) for f, o in zip(firsts, outcomes) if isinstance(o, dict)]
    assert failed == []
    assert len(finished) == 8
    for first, rest in finished:
        assert len(first.token_ids) + len(rest["token_ids"]) == LONG_TOKENS
        assert rest["finish_reason"] == pb.FINISH_REASON_LENGTH

    # The rest of the run goes to the surviving engine.
    before = healthy.load(1).prefix_cache_queries
    results = run_all(clients, prompts(8, 5, vocab), temperature=0, max_tokens=4)
    assert all(r["finish_reason"] == pb.FINISH_REASON_LENGTH for r in results)
    assert healthy.load(1).prefix_cache_queries - before == 8 * PROMPT_LEN

    # The same address comes back: both frontends route to it again.
    started = time.monotonic()
    healthy.restart_engine(0)
    assert time.monotonic() - started < 60
    before = queries(healthy)
    run_all(clients, prompts(8, 6, vocab), temperature=0, max_tokens=4)
    served = served_since(healthy, before)
    assert sum(served) == 8 and served[0] > 0, f"the restarted engine got no requests: {served}"
