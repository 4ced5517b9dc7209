"""Prefill/decode disaggregation between engines whose caches are split over ranks (TP and PP > 1, worker
processes over gloo on CPU), over real gRPC on loopback.

The oracle is one engine alone, without P/D and without parallelism (float32 greedy: tokens exact,
logprobs within 1e-4, since a TP all-reduce sums in another order). A TP=2 producer's blocks are
gathered from both ranks and installed rank by rank in a TP=2 consumer; a producer of two pipeline
stages (3 layers: uneven, so the gather pads) feeds a one-device consumer, the wire order making the stages
invisible. An unequal TP is refused at the handshake by name and recomputed; a dead producer is
recomputed. Every KV block comes back on both sides.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from engine_svc.core import EngineCore
from engine_svc.kv_transfer.blocks import read_shard
from engine_svc.kv_transfer.config import KVTransferConfig
from engine_svc.kv_transfer.puller import layout_to_pb
from engine_svc.kv_transfer.shards import RankShard, shard_slice, wire_order
from shared_runtime.contract import EngineCoreRequest, EngineSamplingParams
from tests.engine.test_engine_server import ServerThread
from tests.engine.test_kv_transfer import (
    GREEDY,
    NUM_BLOCKS,
    PROMPT,
    _all_free,
    _assert_close,
    _config,
    _decode_request,
    _prefill,
    _pull,
    _run,
    _serve,
    _stop,
)
from tests.engine_stream import EngineStream, engine_idle, engine_load
from tests.support import wait_until

pytestmark = pytest.mark.timeout(240)
BUSY_PROMPT, BUSY_TOKENS = [7, 8, 9, 10, 11, 12, 13, 14], 160  # 42 blocks, and 5 kept by a prefill: < 64


@pytest.fixture(scope="module")
def tp_producer(llama_dir: Path) -> Iterator[ServerThread]:
    running = _serve(_config(llama_dir, KVTransferConfig(kv_role="kv_producer"), tensor_parallel_size=2))
    yield running
    _stop(running)


@pytest.fixture(scope="module")
def one_engine(llama_dir: Path) -> EngineCore:
    return EngineCore(_config(llama_dir))


def _tp_consumer(model: Path, **more: Any) -> EngineCore:
    return EngineCore(_config(model, KVTransferConfig(kv_role="kv_consumer", kv_pull_timeout_s=20), **more))


def _expected(core: EngineCore, request_id: str, prompt: list[int] = PROMPT,
              **params: Any) -> tuple[list[int], list[Any]]:
    tokens, logprobs, _ = _run(core, EngineCoreRequest(request_id=request_id, prompt_token_ids=prompt,
                                                        sampling_params=EngineSamplingParams(**{**GREEDY, **params})))
    return tokens, logprobs


def _continue_and_check(consumer: EngineCore, request_id: str, first: Any, want: tuple[list[int], list[Any]],
                        pulled: int, failures: int) -> None:
    """Continue `first` (the producer's output) on `consumer`: the one engine's tokens (`want`), logprobs within
    1e-4, `pulled` blocks pulled and `failures` pulls failed."""
    rest, rest_logprobs, _ = _run(consumer, _decode_request(request_id, PROMPT, GREEDY, first), timeout=60)
    assert list(first.new_token_ids) + rest == want[0]
    _assert_close(list(first.new_logprobs) + rest_logprobs, want[1])
    connector = consumer.kv_connector
    assert connector is not None and (connector.num_blocks_pulled, connector.num_pull_failures) == (pulled, failures)


def test_tp2_producer_to_tp2_consumer_equals_one_engine(tp_producer: ServerThread, one_engine: EngineCore,
                                                        llama_dir: Path) -> None:
    want = _expected(one_engine, "u-tp")
    first = _prefill(tp_producer, "p-tp", PROMPT, GREEDY)
    assert list(first.new_token_ids) == want[0][:1]
    assert engine_load(tp_producer.address).num_free_blocks == NUM_BLOCKS - 5  # held for the pull
    consumer = _tp_consumer(llama_dir, tensor_parallel_size=2)
    busy_want, _ = _expected(one_engine, "u-busy", BUSY_PROMPT, max_tokens=BUSY_TOKENS)
    channel = tp_producer.channel()
    busy = EngineStream(channel)  # the producer keeps stepping while it serves the pull
    try:
        busy.add("busy", BUSY_PROMPT, max_tokens=BUSY_TOKENS)
        busy.wait(lambda: bool(busy.tokens("busy")), timeout=30, what="the busy request's first token")
        assert busy.last("busy") is None
        _continue_and_check(consumer, "d-tp", first, want, pulled=5, failures=0)
        busy.wait_finished("busy", timeout=60)
        assert busy.tokens("busy") == busy_want
        assert consumer.scheduler.get_stats().prefix_cache_hits == 0
        assert _all_free(consumer)
    finally:
        busy.close()
        channel.close()
        consumer.shutdown()
    wait_until(lambda: engine_idle(tp_producer.address), 15, "the producer's blocks freed after the pull")


def test_the_wire_bytes_hold_every_rank_s_heads(tp_producer: ServerThread, one_engine: EngineCore) -> None:
    """What a TP=2 producer sends is, block by block, rank 0's KV heads then rank 1's: the same bytes as a
    one-device engine's blocks of that prompt with their heads split in two (float32: within 1e-4)."""
    first = _prefill(tp_producer, "p-wire", PROMPT, GREEDY)
    layout = tp_producer.server.servicer.core.kv_connector.layout  # type: ignore[union-attr]
    assert (layout.tensor_parallel_size, layout.num_kv_heads, layout.num_layers) == (2, 2, 2)
    with tp_producer.channel() as channel:
        from tandem.engine.v1 import engine_core_pb2 as epb
        from tandem.engine.v1 import engine_core_pb2_grpc as epb_grpc

        data = b"".join(c.data for c in epb_grpc.EngineCoreServiceStub(channel).PullKvBlocks(
            epb.PullKvBlocksRequest(request_id="p-wire", layout=layout_to_pb(layout)), timeout=20))
    wait_until(lambda: engine_idle(tp_producer.address), 15, "the pull frees the blocks")
    # The same prompt on one device: its blocks, heads split between two would-be ranks.
    _run(one_engine, EngineCoreRequest(request_id="u-wire", prompt_token_ids=PROMPT,
                                       sampling_params=EngineSamplingParams(max_tokens=1, temperature=0)))
    caches = one_engine.executor.worker.runner.kv_caches  # type: ignore[attr-defined]
    block_ids = [b.block_id for b in one_engine.scheduler.kv.get_computed_blocks(_probe(PROMPT))[0]]
    assert len(block_ids) == 4  # the full blocks stay in the prefix cache
    assert caches[0].shape[2] == 2  # the CPU (torch) backend's layout: (2, blocks, heads, size, dim)
    halves = [[c.narrow(2, r, 1) for c in caches] for r in range(2)]
    want = torch.cat([read_shard([h.contiguous() for h in half], block_ids) for half in halves], dim=1)
    got = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(5, -1)[:4]
    assert got.shape == want.shape and len(first.new_token_ids) == 1
    torch.testing.assert_close(got.view(torch.float32), want.view(torch.float32), atol=1e-4, rtol=0)


def _probe(prompt: list[int]) -> Any:
    """A request whose prefix-cache lookup finds `prompt`'s full blocks (the scheduler's own type)."""
    from engine_svc.request import Request

    return Request(EngineCoreRequest(request_id="probe", prompt_token_ids=prompt,
                                     sampling_params=EngineSamplingParams(max_tokens=1)), 256)


def test_unequal_tp_is_refused_by_name_and_recomputed(tp_producer: ServerThread, one_engine: EngineCore,
                                                      llama_dir: Path) -> None:
    want = _expected(one_engine, "u-uneq")
    first = _prefill(tp_producer, "p-uneq", PROMPT, GREEDY)
    consumer = _tp_consumer(llama_dir)  # one device
    try:
        layout = consumer.kv_connector.layout  # type: ignore[union-attr]
        with pytest.raises(grpc.RpcError) as refused:
            _pull(tp_producer, "p-uneq", layout_to_pb(layout))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "tensor_parallel_size is 2 here and 1 on the caller" in (refused.value.details() or "")
        wait_until(lambda: engine_idle(tp_producer.address), 15, "a refused pull frees the blocks")
        first = _prefill(tp_producer, "p-uneq2", PROMPT, GREEDY)
        _continue_and_check(consumer, "d-uneq", first, want, pulled=0, failures=1)
        assert _all_free(consumer)
    finally:
        consumer.shutdown()
    wait_until(lambda: engine_idle(tp_producer.address), 15, "the refused pull ended the lease")


@pytest.mark.slow
def test_a_dead_tp_producer_is_recomputed_by_a_tp_consumer(one_engine: EngineCore, llama_dir: Path) -> None:
    want = _expected(one_engine, "u-dead")
    producer = _serve(_config(llama_dir, KVTransferConfig(kv_role="kv_producer"), tensor_parallel_size=2))
    try:
        first = _prefill(producer, "p-dead", PROMPT, GREEDY)
    finally:
        _stop(producer)  # the producer (and its worker processes) gone, its K/V with it
    consumer = _tp_consumer(llama_dir, tensor_parallel_size=2)
    try:
        _continue_and_check(consumer, "d-dead", first, want, pulled=0, failures=1)
        assert _all_free(consumer)
    finally:
        consumer.shutdown()


@pytest.mark.slow
def test_a_pipeline_producer_feeds_a_one_device_consumer(make_model: Any) -> None:
    """Two stages of 2 and 1 layers (the gather pads the smaller shard) to one device: the wire order
    puts a TP rank's stages back in layer order, so the stages need not match."""
    model = make_model("llama", num_layers=3)
    one = EngineCore(_config(model))
    try:
        want = _expected(one, "u-pp")
    finally:
        one.shutdown()
    producer = _serve(_config(model, KVTransferConfig(kv_role="kv_producer"), pipeline_parallel_size=2))
    consumer = _tp_consumer(model)
    try:
        first = _prefill(producer, "p-pp", PROMPT, GREEDY)
        _continue_and_check(consumer, "d-pp", first, want, pulled=5, failures=0)
        wait_until(lambda: engine_idle(producer.address), 15, "the producer's blocks freed after the pull")
        assert _all_free(consumer)
    finally:
        consumer.shutdown()
        _stop(producer)


def test_the_wire_order_is_layer_order_within_each_tp_rank() -> None:
    """TP=2 x PP=2 (stages of 2 and 1 layers) and TP=2 x PP=1 cut a block's bytes at the same places: a
    TP rank's part is all its layers in order, whatever the stages."""
    layer = RankShard(1, (2, 1, 4, 8), "float32", 2)
    staged = [RankShard(2, layer.block_shape, "float32", 2)] * 2 + [layer] * 2  # ranks 0, 1: stage 0
    flat = [RankShard(3, layer.block_shape, "float32", 2)] * 2
    assert wire_order(2, 2) == [0, 2, 1, 3]
    per_layer = layer.block_bytes
    assert [shard_slice(staged, r, 2, 2) for r in range(4)] == [
        _slice(0, 2 * per_layer), _slice(3 * per_layer, 2 * per_layer),
        _slice(2 * per_layer, per_layer), _slice(5 * per_layer, per_layer)]
    assert [shard_slice(flat, r, 2, 1) for r in range(2)] == [_slice(0, 3 * per_layer),
                                                              _slice(3 * per_layer, 3 * per_layer)]


def _slice(offset: int, size: int) -> Any:
    from engine_svc.kv_transfer.blocks import ShardSlice

    return ShardSlice(offset, size, 6 * RankShard(1, (2, 1, 4, 8), "float32", 2).block_bytes)
