"""Prefill/decode disaggregation on SmolLM2-135M-Instruct (float32): a chat prompt prefilled on a served
producer engine and decoded on a consumer engine that pulls its K/V gives transformers' greedy tokens,
and exactly the tokens and logprobs of one tandem engine alone."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from engine_svc.api.server import EngineServer
from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from engine_svc.kv_transfer.config import KVTransferConfig
from shared_runtime.contract import EngineCoreRequest, EngineSamplingParams
from tests.engine.test_engine_server import ServerThread
from tests.engine.test_kv_transfer import _decode_request, _logprob_rows, _prefill, _run
from tests.engine_stream import engine_idle
from tests.realmodel.support import MAX_TOKENS, greedy
from tests.support import wait_until

pytestmark = pytest.mark.slow


def _config(model: Path, kv: KVTransferConfig | None = None) -> EngineConfig:
    return EngineConfig.create(model=str(model), dtype="float32", device="cpu", max_model_len=512,
                               num_gpu_blocks_override=64, max_num_seqs=4, kv_transfer_config=kv)


def test_pd_on_smollm2_equals_one_engine_and_transformers(smollm2_dir: Path, hf: Any,
                                                          chat_ids: Callable[[str], list[int]]) -> None:
    prompt = chat_ids("Name three rivers in Europe and say which country each flows through.")
    params = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "logprobs": 2}
    unified = EngineCore(_config(smollm2_dir))
    want, want_logprobs, _ = _run(unified, EngineCoreRequest(
        request_id="u", prompt_token_ids=prompt, sampling_params=EngineSamplingParams(**params)), timeout=300)
    unified.shutdown()
    producer = ServerThread(EngineServer(_config(smollm2_dir, KVTransferConfig(kv_role="kv_producer")),
                                         host="127.0.0.1", port=0)).start()
    try:
        wait_until(lambda: engine_idle(producer.address), 120, "producer up", retry_on=(grpc.RpcError,))
        first = _prefill(producer, "p", prompt, params)
        consumer = EngineCore(_config(smollm2_dir, KVTransferConfig(kv_role="kv_consumer")))
        rest, rest_logprobs, _ = _run(consumer, _decode_request("d", prompt, params, first), timeout=300)
        assert consumer.kv_connector is not None
        assert consumer.kv_connector.num_blocks_pulled == -(-len(prompt) // 16)
        consumer.shutdown()
        got = list(first.new_token_ids) + rest
        assert got == want == greedy(hf, prompt, MAX_TOKENS)[:len(want)]
        assert _logprob_rows(list(first.new_logprobs) + rest_logprobs) == _logprob_rows(want_logprobs)
        wait_until(lambda: engine_idle(producer.address), 10, "the producer's blocks freed")
    finally:
        producer.begin_drain()
        producer.join(30)
