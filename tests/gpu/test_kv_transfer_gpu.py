"""P/D disaggregation on a real GPU: blocks read from one CUDA cache (staged through host memory) and
written into another are bit-identical, and a request prefilled on a CUDA producer engine and decoded on a
CUDA consumer engine gives one CUDA engine's tokens (logprobs within 1e-5: CUDA-graph replays of another
batch shape round differently), with every block back on both sides."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from tests.engine.test_kv_transfer import PROMPT, _decode_request, _prefill, _run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_blocks_round_trip_through_host_memory_bit_exact() -> None:
    from engine_svc.kv_transfer.blocks import read_blocks, write_blocks

    torch.manual_seed(0)
    source = [torch.randn(2, 40, 16, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    target = [torch.zeros_like(c) for c in source]
    data = read_blocks(source, [3, 17, 5])
    write_blocks(target, [0, 1, 2], data)
    for s, t in zip(source, target, strict=True):
        assert torch.equal(t[:, [0, 1, 2]], s[:, [3, 17, 5]])
        assert not t[:, 3:].any()


def test_a_cuda_caches_staging_buffer_is_pinned() -> None:
    """A pull from a CUDA cache stages each span through page-locked host memory (blocks.staging_buffer)."""
    from engine_svc.kv_transfer.blocks import staging_buffer

    buffer = staging_buffer(1 << 20, torch.device("cuda"))
    assert len(buffer) == 1 << 20 and torch.frombuffer(buffer, dtype=torch.uint8).is_pinned()


def test_a_read_into_a_host_staging_buffer_equals_a_fresh_read() -> None:
    """The producer's span reads (source.py) gather on the device and copy into a reused host buffer."""
    import numpy

    from engine_svc.kv_transfer.blocks import read_blocks

    torch.manual_seed(0)
    source = [torch.randn(2, 40, 16, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    fresh = bytes(read_blocks(source, [3, 17, 5]))
    staging = numpy.full(len(fresh) + 64, 0xAB, dtype=numpy.uint8).data
    for block_ids in ([8, 1], [3, 17, 5]):  # a second read into the same buffer overwrites the first
        into = read_blocks(source, block_ids, staging)
    assert bytes(into) == fresh and bytes(staging[len(fresh):]) == b"\xab" * 64


def _config(model: Path, kv: Any = None) -> Any:
    from engine_svc.config import EngineConfig

    return EngineConfig.create(model=str(model), dtype="float32", device="cuda", attention_backend="triton",
                               max_model_len=128, block_size=16, num_gpu_blocks_override=64, max_num_seqs=4,
                               kv_transfer_config=kv)


def test_prefill_on_one_gpu_engine_decode_on_another(llama_dir: Path) -> None:
    from engine_svc.api.server import EngineServer
    from engine_svc.core import EngineCore
    from engine_svc.kv_transfer.config import KVTransferConfig
    from shared_runtime.contract import EngineCoreRequest, EngineSamplingParams
    from tests.engine.test_engine_server import ServerThread
    from tests.engine_stream import engine_idle
    from tests.support import wait_until

    params = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True, "logprobs": 1}
    unified = EngineCore(_config(llama_dir))
    want, want_logprobs, _ = _run(unified, EngineCoreRequest(request_id="u", prompt_token_ids=PROMPT,
                                                             sampling_params=EngineSamplingParams(**params)), 120)
    unified.shutdown()
    producer = ServerThread(EngineServer(_config(llama_dir, KVTransferConfig(kv_role="kv_producer")),
                                         host="127.0.0.1", port=0)).start()
    try:
        wait_until(lambda: engine_idle(producer.address), 120, "producer up", retry_on=(grpc.RpcError,))
        first = _prefill(producer, "p", PROMPT, params)
        consumer = EngineCore(_config(llama_dir, KVTransferConfig(kv_role="kv_consumer")))
        rest, rest_logprobs, _ = _run(consumer, _decode_request("d", PROMPT, params, first), 120)
        assert consumer.kv_connector is not None and consumer.kv_connector.num_blocks_pulled == 2
        assert list(first.new_token_ids) + rest == want
        got = list(first.new_logprobs) + rest_logprobs
        assert max(abs(a.logprob - b.logprob) for a, b in zip(got, want_logprobs, strict=True)) < 1e-5
        kv = consumer.scheduler.kv
        assert kv.num_free_blocks == kv.num_blocks
        consumer.shutdown()
        wait_until(lambda: engine_idle(producer.address), 10, "the producer's blocks freed")
    finally:
        producer.begin_drain()
        producer.join(30)
