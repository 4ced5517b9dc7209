"""End to end over real sockets: `tandem-engine` and `tandem-frontend` processes configured only by
`OTEL_*` variables export to an OTLP/gRPC receiver in the test; their /metrics ports are scraped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from tandem.v1 import generation_pb2_grpc as pb_grpc

from frontend_svc.client import generate_request
from tests.observability.otlp_receiver import OtlpReceiver
from tests.observability.support import KV_CACHE_BYTES, scrape
from tests.support import free_port, is_serving, wait_until

ROOT = Path(__file__).resolve().parents[2]
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


def start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", *argv], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return int(proc.returncode)


@pytest.mark.slow
def test_services_export_one_trace_to_an_otlp_receiver(make_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model = make_model("llama")
    engine_port, frontend_port, engine_metrics, frontend_metrics = (free_port() for _ in range(4))
    with OtlpReceiver() as receiver:
        base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env = {**base, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "protos")]), "TOKENIZERS_PARALLELISM": "false",
               "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
               "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_TRACES_SAMPLER": "parentbased_always_on",
               "OTEL_BSP_SCHEDULE_DELAY": "100"}
        engine = start(["engine_svc.cli", "--model", str(model), "--host", "127.0.0.1",
                        "--port", str(engine_port), "--metrics-port", str(engine_metrics), "--dtype", "float32",
                        "--max-num-seqs", "4", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
                        "--log-stats-interval", "0.3"],
                       env, tmp_path / "engine.log")
        frontend = start(["frontend_svc.cli", "--model", str(model), "--engine", f"127.0.0.1:{engine_port}",
                          "--host", "127.0.0.1", "--port", str(frontend_port),
                          "--metrics-port", str(frontend_metrics)], env, tmp_path / "frontend.log")
        try:
            wait_until(lambda: is_serving(f"127.0.0.1:{frontend_port}"), 120, "the frontend SERVING")
            with grpc.insecure_channel(f"127.0.0.1:{frontend_port}") as channel:
                responses = list(pb_grpc.GenerationServiceStub(channel).Generate(
                    generate_request(token_ids=[9, 8, 7, 6], max_tokens=3, ignore_eos=True), timeout=60,
                    metadata=[("traceparent", f"00-{TRACE_ID}-{CLIENT_SPAN}-01")]))
            assert sum(len(r.token_ids) for r in responses) == 3

            def ours() -> list:  # type: ignore[type-arg]
                return [s for s in receiver.spans() if s.trace_id == TRACE_ID]
            wait_until(lambda: len(ours()) >= 3, 20, "three spans of the trace")
            spans = {s.service: s for s in ours() if s.name != "tandem.frontend.prepare"}
            assert set(spans) == {"tandem-frontend", "tandem-engine"}
            assert spans["tandem-frontend"].parent_span_id == CLIENT_SPAN
            assert spans["tandem-engine"].parent_span_id == spans["tandem-frontend"].span_id
            assert spans["tandem-engine"].attributes["gen_ai.usage.output_tokens"] == 3
            assert spans["tandem-engine"].events == ("queued", "scheduled", "first_token", "finished")
            assert "tandem_generation_tokens_total" in scrape(engine_metrics)
            wait_until(lambda: "Avg generation throughput: " in (tmp_path / "engine.log").read_text(), 10,
                       "the engine's stats line")
            assert 'tandem_request_success_total{finished_reason="length"' in scrape(frontend_metrics)
        finally:
            assert stop(frontend) == 0
            assert stop(engine) == 0
