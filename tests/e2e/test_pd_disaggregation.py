"""Prefill/decode disaggregation end to end: engine and frontend processes on loopback.

A producer engine (`kv_role: kv_producer`) and a consumer engine (`kv_consumer`) behind a frontend with
`--routing pd`: each request is prefilled on the producer and decoded on the consumer, which pulls the
prompt's K/V over PullKvBlocks. The oracle is the same workload through a second frontend whose only
engine is the producer serving plain requests (one engine alone): every completion's text, tokens,
logprobs, finish reason and usage are the same. Afterwards every KV block is back on both engines, and
the consumer's metrics show the blocks it pulled. Killing the producer mid-workload loses no request:
prefills move to the consumer (migration) and pulls that fail are recomputed there.
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc as pb_grpc

from tests.e2e.test_migration import assert_same, run_all, workload
from tests.engine_stream import engine_idle
from tests.support import Service, free_port, metric_value, wait_until

pytestmark = pytest.mark.slow

ENGINE_FLAGS = ("--dtype", "float32", "--max-num-seqs", "32", "--kv-cache-memory-bytes", str(64 << 20))


def _engine(model: Path, log_dir: Path, role: str, *flags: str) -> tuple[Service, int]:
    port, metrics = free_port(), free_port()
    kv = json.dumps({"kv_connector": "GrpcConnector", "kv_role": role})
    argv = [sys.executable, "-m", "engine_svc.cli", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--metrics-port", str(metrics), *ENGINE_FLAGS, "--kv-transfer-config", kv, *flags]
    return Service("engine", argv, port, log_dir), metrics


def _frontend(model: Path, log_dir: Path, engines: list[Service], routing: str) -> Service:
    port = free_port()
    argv = [sys.executable, "-m", "frontend_svc.cli", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--engine", ",".join(e.address for e in engines), "--metrics-port", "0", "--routing", routing,
            "--max-concurrent-requests", "128", "--migration-timeout", "5"]
    return Service("frontend", argv, port, log_dir)


class PD:
    def __init__(self, model: Path, log_dir: Path) -> None:
        # No prefix cache on the producer: the oracle's runs there must not warm the prefills of the P/D runs.
        self.producer, _ = _engine(model, log_dir, "kv_producer", "--no-enable-prefix-caching")
        self.consumer, self.consumer_metrics = _engine(model, log_dir, "kv_consumer")
        self.services = [self.producer.start(), self.consumer.start()]
        for e in self.services:
            e.wait_serving()
        self.pd = _frontend(model, log_dir, self.services, "pd").start()
        self.plain = _frontend(model, log_dir, [self.producer], "least-load").start()
        self.services += [self.pd, self.plain]
        self.pd.wait_serving()
        self.plain.wait_serving()
        self.channels = [grpc.insecure_channel(f.address) for f in (self.pd, self.plain)]
        self.pd_api, self.plain_api = (pb_grpc.GenerationServiceStub(c) for c in self.channels)
        wait_until(lambda: self.pd_api.GetModelInfo(pb.GetModelInfoRequest(), timeout=5).num_ready_engines == 2,
                   30, "the P/D frontend sees both engines")

    def pulled_blocks(self) -> float:
        return metric_value(self.consumer_metrics, "tandem_kv_transfer_blocks_pulled_total")

    def close(self) -> None:
        for c in self.channels:
            c.close()
        for s in reversed(self.services):
            s.stop()


@pytest.fixture
def pd(make_model: Any, tmp_path: Path) -> Iterator[PD]:
    cluster = PD(make_model("llama"), tmp_path)
    try:
        yield cluster
    finally:
        cluster.close()


def _via(api: pb_grpc.GenerationServiceStub) -> Any:
    return type("Via", (), {"api": api})()


def test_pd_through_the_frontend_equals_one_engine(pd: PD) -> None:
    requests = workload(int(pd.pd_api.GetModelInfo(pb.GetModelInfoRequest(), timeout=5).vocab_size))
    alone = run_all(_via(pd.plain_api), requests)
    disaggregated = run_all(_via(pd.pd_api), requests)
    assert_same(disaggregated, alone)
    assert pd.pulled_blocks() > 0
    for engine in (pd.producer, pd.consumer):  # every KV block back (the producer's kept ones pulled)
        wait_until(lambda e=engine: engine_idle(e.address), 10, f"{engine.address} idle")


def test_killing_the_producer_mid_workload_loses_no_request(pd: PD) -> None:
    requests = workload(int(pd.pd_api.GetModelInfo(pb.GetModelInfoRequest(), timeout=5).vocab_size))
    alone = run_all(_via(pd.plain_api), requests)
    disturbed = run_all(_via(pd.pd_api), requests, lambda: pd.producer.kill(signal.SIGKILL))
    assert_same(disturbed, alone)
    wait_until(lambda: engine_idle(pd.consumer.address), 10, "the consumer idle")
