"""What grpcio's server costs per streamed message on its own: the floor under the frontend's gRPC figure.

A bare server-streaming method that writes a small fixed message (bytes, no protobuf, no servicer work)
into 128 concurrent streams over 4 client connections, the server alone on CPU 1 and the client on CPU 0,
as bench/frontend_capacity.py --pin places the frontend. The server's CPU time (user + system, /proc)
per message delivered, for:

- `aio`: grpc.aio, `await context.write(message)` per message, as fast as the client reads (a burst: the
  per-message cost when the server is busy, completions queue up);
- `aio-tick`: grpc.aio, each stream writes one message per tick (`--tick-ms`, one shared ticker sets an
  event all streams wait on: one engine step reaching every stream, as in the frontend);
- `aio-tick-gen`: `aio-tick` with the handler an async generator yielding each message (grpc.aio's other
  way to stream a response) instead of awaiting `context.write`;
- `sync`: grpc's thread-pool server, the handler yielding messages (a burst).

    python bench/grpc_floor.py [--modes aio aio-tick aio-tick-gen sync] [--messages 256] [--tick-ms 40] [--rounds 2]

Run it under `/work/bin/quiet` on the shared box. Nothing of tandem is imported: it is grpcio alone.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from concurrent import futures
from typing import Any

import grpc

MESSAGE = b"\x08\x01\x12\x05 boat\x1a\x02\x8c\x27"  # about a one-token GenerateResponse's size
METHOD = "/floor.Floor/Stream"


def handler_for(mode: str, messages: int, tick_s: float) -> Any:
    if mode == "sync":
        def sync_stream(request: bytes, context: Any) -> Any:
            for _ in range(messages):
                yield MESSAGE
        return grpc.unary_stream_rpc_method_handler(sync_stream)

    tick: dict[str, Any] = {}  # "event": the current tick's, set when it ends; "task": the ticker

    async def ticker() -> None:
        while True:
            await asyncio.sleep(tick_s)
            tick["event"], event = asyncio.Event(), tick["event"]
            event.set()

    def start_ticker() -> None:
        if not tick:
            tick["event"] = asyncio.Event()
            tick["task"] = asyncio.get_running_loop().create_task(ticker())

    if mode == "aio-tick-gen":
        async def aio_generator(request: bytes, context: Any) -> Any:
            start_ticker()
            for _ in range(messages):
                await tick["event"].wait()
                yield MESSAGE
        return grpc.unary_stream_rpc_method_handler(aio_generator)

    async def aio_stream(request: bytes, context: Any) -> None:
        write = context.write
        if mode == "aio":
            for _ in range(messages):
                await write(MESSAGE)
            return
        start_ticker()
        for _ in range(messages):
            await tick["event"].wait()
            await write(MESSAGE)
    return grpc.unary_stream_rpc_method_handler(aio_stream)


def serve(mode: str, port: int, messages: int, tick_s: float) -> None:
    service, method = METHOD.strip("/").split("/")
    handlers = grpc.method_handlers_generic_handler(service, {method: handler_for(mode, messages, tick_s)})
    if mode == "sync":
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=160))
        server.add_generic_rpc_handlers((handlers,))
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        print("ready", flush=True)
        server.wait_for_termination()
        return

    async def main() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handlers,))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()
    asyncio.run(main())


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def read_streams(port: int, streams: int, connections: int) -> int:
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(connections)]

    async def one(i: int) -> int:
        count = 0
        async for _ in channels[i % connections].unary_stream(METHOD)(b""):
            count += 1
        return count
    try:
        return sum(await asyncio.gather(*(one(i) for i in range(streams))))
    finally:
        for channel in channels:
            await channel.close()


def measure(mode: str, port: int, args: argparse.Namespace) -> tuple[float, float]:
    """(server µs of CPU per message, server CPU / wall) of one run."""
    server = subprocess.Popen(["taskset", "-c", "1", sys.executable, __file__, "--serve", mode, "--port", str(port),
                               "--messages", str(args.messages), "--tick-ms", str(args.tick_ms)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        asyncio.run(read_streams(port, 8, 1))  # warm up: connections, code paths
        before, start = cpu_seconds(server.pid), time.perf_counter()
        delivered = asyncio.run(read_streams(port, args.streams, args.connections))
        wall = time.perf_counter() - start
        used = cpu_seconds(server.pid) - before
        assert delivered == args.streams * args.messages
        return used / delivered * 1e6, used / wall
    finally:
        server.kill()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["aio", "aio-tick", "sync"], choices=["aio", "aio-tick", "aio-tick-gen", "sync"])
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--messages", type=int, default=256, help="messages per stream")
    parser.add_argument("--tick-ms", type=float, default=40.0, help="aio-tick: one message per stream per tick")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port, args.messages, args.tick_ms / 1000)
        return
    os.sched_setaffinity(0, {0})
    print(f"{args.streams} streams x {args.messages} messages of {len(MESSAGE)} bytes over {args.connections} "
          f"connections; server on CPU 1, client on CPU 0; µs of server CPU per message (server busy)")
    base_port = 43000 + os.getpid() % 1000 * 10
    for mode in args.modes:
        runs = [measure(mode, base_port + r * len(args.modes) + args.modes.index(mode), args)
                for r in range(args.rounds)]
        label = f"{mode} ({args.tick_ms:g} ms)" if mode.startswith("aio-tick") else mode
        per_message = statistics.median(r[0] for r in runs)
        rounds = ", ".join(f"{r[0]:.1f}" for r in runs)
        print(f"  {label:16s} {per_message:6.1f} us/msg  (rounds: {rounds}; busy {statistics.median(r[1] for r in runs):.2f})",
              flush=True)


if __name__ == "__main__":
    main()
