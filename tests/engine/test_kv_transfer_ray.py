"""Prefill/decode disaggregation between engines whose ranks are Ray actors (`--distributed-executor-backend
ray`, CPU bundles, gloo), over real gRPC on loopback.

A TP=2 producer on Ray keeps its blocks after the prefill; a TP=2 consumer on Ray pulls them (every rank's
shard gathered to the producer's answer rank by KV_READ, a broadcast that the producer's step loop and the
pull's thread never interleave), installs them rank by rank and decodes: the tokens of one engine alone
(float32 greedy; logprobs within 1e-4), while the producer keeps stepping another request. Every KV block
comes back on both sides.

One local Ray cluster for the module (4 CPUs: two engines of two actors each), this process its driver.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_svc.core import EngineCore
from engine_svc.kv_transfer.config import KVTransferConfig
from tests.engine.test_kv_transfer import (
    GREEDY,
    NUM_BLOCKS,
    PROMPT,
    _all_free,
    _config,
    _prefill,
    _serve,
    _stop,
)
from tests.engine.test_kv_transfer_tp import BUSY_PROMPT, BUSY_TOKENS, _continue_and_check, _expected
from tests.engine.test_ray_executor import ray_session  # noqa: F401 (a fixture: one local Ray cluster)
from tests.engine_stream import EngineStream, engine_idle, engine_load
from tests.support import wait_until

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
RAY = dict(distributed_executor_backend="ray", tensor_parallel_size=2)


def test_a_ray_tp2_producer_feeds_a_ray_tp2_consumer_exactly(ray_session: None, llama_dir: Path) -> None:  # noqa: F811
    one_engine = EngineCore(_config(llama_dir))
    want = _expected(one_engine, "u-ray")
    busy_want, _ = _expected(one_engine, "u-busy", BUSY_PROMPT, max_tokens=BUSY_TOKENS)
    one_engine.shutdown()
    producer = _serve(_config(llama_dir, KVTransferConfig(kv_role="kv_producer"), **RAY))
    consumer = None
    channel = producer.channel()
    busy = EngineStream(channel)
    try:
        first = _prefill(producer, "p-ray", PROMPT, GREEDY)
        assert list(first.new_token_ids) == want[0][:1]
        assert engine_load(producer.address).num_free_blocks == NUM_BLOCKS - 5  # held for the pull
        consumer = EngineCore(_config(llama_dir, KVTransferConfig(kv_role="kv_consumer", kv_pull_timeout_s=30),
                                      **RAY))
        busy.add("busy", BUSY_PROMPT, max_tokens=BUSY_TOKENS)  # the producer keeps stepping during the pull
        busy.wait(lambda: bool(busy.tokens("busy")), timeout=60, what="the busy request's first token")
        _continue_and_check(consumer, "d-ray", first, want, pulled=5, failures=0)
        busy.wait_finished("busy", timeout=120)
        assert busy.tokens("busy") == busy_want
        assert _all_free(consumer)
        wait_until(lambda: engine_idle(producer.address), 30, "the producer's blocks freed after the pull")
    finally:
        busy.close()
        channel.close()
        if consumer is not None:
            consumer.shutdown()
        _stop(producer)
