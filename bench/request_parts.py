"""What the frontend's per-request steps cost on the event loop, one at a time, without gRPC (issue 19).

Builds the real `FrontendServer` parts (SmolLM2's tokenizer, metrics on, no engine) and times, per request,
each step a Generate call takes apart from its tokens: telemetry (`begin_call` ... `succeed`), admission
(`open_generation`), `prepare` (chat template, tokenization, sampling parameters) inline, the tokenizer-pool
hand-off (`submit` + `asyncio.wrap_future` of a no-op), building the engine requests and their protobuf
messages, `OutputProcessor.add_request` (the prompt's detokenizer priming) and the abort at the end.

    python bench/request_parts.py [--n 2000]

Figures are µs of process CPU time (all threads) per request, best of 5 repetitions of `--n` requests (warm caches,
no other work between steps, so a lower bound on what each step costs inside the server).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.frontend_capacity import grpc_payload  # noqa: E402


def best_us(fn: Callable[[], object], n: int, repeat: int = 5) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        for _ in range(n):
            fn()
        best = min(best, time.process_time() - start)
    return best / n * 1e6


async def best_us_async(fn: Callable[[], object], n: int, repeat: int = 5) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        for _ in range(n):
            await fn()  # type: ignore[misc]
        best = min(best, time.process_time() - start)
    return best / n * 1e6


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000)
    args = parser.parse_args()
    from tandem.v1 import generation_pb2 as pb

    from entrypoints.demo_model import demo_gguf_path
    from frontend_svc.config import FrontendConfig
    from frontend_svc.server import FrontendServer
    from frontend_svc.telemetry.service import FrontendTelemetry
    from frontend_svc.tokenizer import Tokenizer
    from shared_runtime.to_pb import add_to_pb

    gguf = demo_gguf_path()
    tokenizer = Tokenizer.from_pretrained(gguf)
    telemetry = FrontendTelemetry.from_env("m", 0)
    from frontend_svc.telemetry.metrics import FrontendMetrics
    telemetry.metrics = FrontendMetrics("m")  # metrics on, as the bench's frontend (no /metrics server)
    server = FrontendServer(FrontendConfig(model=str(gguf), metrics_port=0, max_concurrent_requests=1 << 30),
                            tokenizer=tokenizer, telemetry=telemetry)
    request = pb.GenerateRequest.FromString(grpc_payload("plain", 256))
    metadata = (("user-agent", "grpc-python/1.0"),)
    prepared = server.prepare(request)
    n = args.n
    rows: list[tuple[str, float]] = []

    def telemetry_call() -> None:
        call = server.telemetry.begin_call(metadata)
        call.prepare(lambda: prepared)
        call.trace_headers()
        call.routed("127.0.0.1:1", 1)
        call.succeed()
    rows.append(("telemetry: begin_call + prepare wrapper + routed + succeed", best_us(telemetry_call, n)))

    def admission() -> None:
        call = server.telemetry.begin_call(metadata)
        server.open_generation(1, call).close()
    rows.append(("admission: begin_call + open_generation + close (no request)", best_us(admission, n)))
    rows.append(("prepare (chat template, tokenize, params) inline", best_us(lambda: server.prepare(request), n // 4)))
    rows.append(("  sampling_params_from_pb", best_us(
        lambda: __import__("frontend_svc.grpc_api.wire", fromlist=["x"]).sampling_params_from_pb(request.sampling_params), n)))

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)

    async def hand_off() -> None:
        await asyncio.wrap_future(pool.submit(int))
    rows.append(("pool hand-off: submit + wrap_future of a no-op", await best_us_async(hand_off, n)))

    async def prepare_on_pool() -> None:
        await asyncio.wrap_future(pool.submit(server.prepare, request))
    rows.append(("prepare on the pool (awaited alone)", await best_us_async(prepare_on_pool, n // 4)))

    call = server.telemetry.begin_call(metadata)
    rows.append(("engine_requests (1 completion)", best_us(lambda: server.processor.engine_requests(prepared, {}), n)))
    engine_requests = server.processor.engine_requests(prepared, {})
    rows.append(("add_to_pb (1 engine request)", best_us(lambda: add_to_pb(engine_requests[0]), n)))
    op = server.output_processor

    def add_and_abort() -> None:
        state = op.add_request(prepared, None)
        op.abort_request(state)
    rows.append(("output_processor.add_request + abort_request", best_us(add_and_abort, n)))
    rows.append(("request.SerializeToString + FromString (the call's request bytes)", best_us(
        lambda: pb.GenerateRequest.FromString(request.SerializeToString()), n)))
    del call
    pool.shutdown()
    print(f"per request, µs (best of 5 x {n}; prompt {len(prepared.prompt_token_ids)} tokens):")
    for name, us in rows:
        print(f"  {us:8.1f}  {name}")


if __name__ == "__main__":
    asyncio.run(main())
