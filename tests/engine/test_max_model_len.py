"""One max_model_len: when the KV cache holds fewer tokens than the configured max_model_len, the engine
serves the lower value, and every worker sizes its persistent batch and CUDA-graph heuristics for it
(the executor hands it over with the block count, in one message to all ranks)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from engine_svc.executor.multiproc import MultiprocExecutor
from engine_svc.worker import worker as worker_module
from engine_svc.worker.worker import Worker
from shared_runtime.contract import EngineCoreRequest, EngineSamplingParams

CONFIGURED, BLOCK_SIZE, BLOCKS = 256, 16, 8  # the cache holds 128 tokens: max_model_len 256 -> 128
SERVED = BLOCKS * BLOCK_SIZE
RECORD_ENV = "TANDEM_TEST_SIZING_DIR"


def _config(model_dir: Path, tp: int = 1) -> EngineConfig:
    return EngineConfig.create(model=str(model_dir), dtype="float32", device="cpu", max_model_len=CONFIGURED,
                               block_size=BLOCK_SIZE, num_gpu_blocks_override=BLOCKS, max_num_seqs=4,
                               tensor_parallel_size=tp)


def _sizing(worker: Any, graph_blocks: int | None) -> dict[str, Any]:
    runner = worker.runner
    return {"rank": worker.rank, "runner": runner.max_model_len, "tokens": runner.batch.token_ids.shape[1],
            "table": runner.batch.block_table.shape[1], "graph_blocks": graph_blocks}


def _expected(rank: int) -> dict[str, Any]:
    return {"rank": rank, "runner": SERVED, "tokens": SERVED, "table": BLOCKS, "graph_blocks": BLOCKS}


class RecordingWorker(Worker):
    """A real worker that writes what it sized itself for (per rank) into $TANDEM_TEST_SIZING_DIR."""

    def initialize_cache(self, num_blocks: int, max_model_len: int) -> None:
        seen: dict[str, int] = {}

        def graphs(*args: Any, staging: Any, **kwargs: Any) -> None:
            seen["blocks"] = staging.block_table.device.shape[1]  # what the CUDA-graph heuristic reads

        worker_module.maybe_capture_decode_graphs = graphs  # type: ignore[assignment]
        super().initialize_cache(num_blocks, max_model_len)
        path = Path(os.environ[RECORD_ENV]) / f"rank{self.rank}.json"
        path.write_text(json.dumps(_sizing(self, seen.get("blocks"))))


def _run_to_the_limit(core: EngineCore) -> None:
    """A request whose prompt + output fill the served max_model_len exactly finishes normally."""
    params = EngineSamplingParams(temperature=0.0, max_tokens=SERVED - 100, ignore_eos=True)
    core.add_request(EngineCoreRequest(request_id="r", prompt_token_ids=list(range(5, 105)), sampling_params=params))
    tokens = 0
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            assert out.error is None, out.error
            tokens += len(out.new_token_ids)
    assert tokens == SERVED - 100


def test_the_served_max_model_len_sizes_the_worker(llama_dir, monkeypatch) -> None:
    seen: dict[str, int] = {}

    def graphs(*args: Any, staging: Any, **kwargs: Any) -> None:
        seen["blocks"] = staging.block_table.device.shape[1]

    monkeypatch.setattr(worker_module, "maybe_capture_decode_graphs", graphs)
    core = EngineCore(_config(llama_dir))
    try:
        assert core.max_model_len == core.executor.max_model_len == SERVED
        worker = core.executor.worker  # type: ignore[attr-defined]
        assert _sizing(worker, seen["blocks"]) == _expected(0)
        _run_to_the_limit(core)
    finally:
        core.shutdown()


@pytest.mark.timeout(180)
def test_every_tp_rank_is_sized_for_the_served_max_model_len(llama_dir, tmp_path, monkeypatch) -> None:
    """TP=2 over gloo: both ranks get the served value before they size anything."""
    monkeypatch.setenv(RECORD_ENV, str(tmp_path))
    config = _config(llama_dir, tp=2)
    core = EngineCore(config, MultiprocExecutor(config, worker_cls=f"{__name__}:RecordingWorker"))
    try:
        assert core.max_model_len == SERVED
        _run_to_the_limit(core)  # its steps all-reduce with rank 1, which sized itself before its first step
        for rank in (0, 1):
            assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == _expected(rank)
    finally:
        core.shutdown()
