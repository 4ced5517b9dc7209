"""vLLM gRPC's GetServerInfo reports the engines' parallelism from their EngineInfo: tensor and pipeline
sizes of one engine, data parallelism = the ready engines, world = their product."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from tandem.engine.v1 import engine_core_pb2 as epb
from tandem.vendor.vllm import control_pb2 as cpb

from frontend_svc.vllm_grpc.control import ControlServicer
from frontend_svc.vllm_grpc.inflight import InFlight


def server_info(*infos: epb.EngineInfo) -> cpb.ServerInfo:
    frontend = SimpleNamespace(ready_engine_infos=lambda: [(f"e{i}", info) for i, info in enumerate(infos)],
                               max_model_len=128)
    servicer = ControlServicer(frontend, InFlight())  # type: ignore[arg-type]
    return asyncio.run(servicer.GetServerInfo(cpb.GetServerInfoRequest(), None))  # type: ignore[arg-type]


def engine(tp: int, pp: int) -> epb.EngineInfo:
    return epb.EngineInfo(block_size=16, num_blocks=10, max_num_seqs=4, max_num_batched_tokens=64,
                          tensor_parallel_size=tp, pipeline_parallel_size=pp)


def test_pipeline_size_comes_from_the_engines_and_counts_in_the_world() -> None:
    p = server_info(engine(2, 3), engine(2, 3)).parallelism
    assert (p.tensor_parallel_size, p.pipeline_parallel_size, p.data_parallel_size, p.world_size) == (2, 3, 2, 12)


def test_an_engine_that_reports_no_pipeline_size_counts_as_one_stage() -> None:
    p = server_info(engine(2, 0)).parallelism
    assert (p.pipeline_parallel_size, p.world_size) == (1, 2)
