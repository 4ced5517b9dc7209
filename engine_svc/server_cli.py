"""`tandem-engine`: serve `tandem.engine.v1.EngineCoreService`.

Start-up order matters: TP worker processes are spawned before any gRPC object exists (gRPC core is not
fork-safe); then the server starts with health NOT_SERVING; then the model loads and the KV cache is
allocated on the busy-loop thread, and health turns SERVING. SIGTERM/SIGINT drain; a second one exits
at once. Exit code 0 after a drain, non-zero after a fatal engine error.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from engine_svc.config import ConfigError, add_engine_args, config_from_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem-engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--metrics-port", type=int, default=9091,
                        help="Prometheus /metrics port (0 disables)")
    parser.add_argument("--max-waiting", type=int, default=None,
                        help="admission limit: requests beyond this many waiting get RESOURCE_EXHAUSTED")
    parser.add_argument("--drain-grace-period", type=float, default=45.0,
                        help="seconds in-flight requests may run after SIGTERM before they are aborted")
    parser.add_argument("--log-level", default="INFO")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"tandem-engine: {exc}", file=sys.stderr)
        return 2
    from engine_svc.executor.base import make_executor

    executor = make_executor(config)  # spawns TP workers now, before gRPC exists
    return asyncio.run(_serve(config, args, executor))


async def _serve(config, args: argparse.Namespace, executor) -> int:
    from engine_svc.server import EngineServer
    from engine_svc.telemetry import EngineTelemetry

    telemetry = EngineTelemetry.from_env(config.model_name, args.metrics_port, args.host)
    server = EngineServer(config, host=args.host, port=args.port, max_waiting=args.max_waiting,
                          drain_grace_s=args.drain_grace_period, executor=executor, telemetry=telemetry)
    loop = asyncio.get_running_loop()
    signals = {"count": 0}

    def on_signal() -> None:
        signals["count"] += 1
        if signals["count"] == 1:
            server.begin_drain()
        else:
            server.force_exit()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    try:
        return await server.run()
    finally:
        telemetry.shutdown()  # flush the last spans


if __name__ == "__main__":
    sys.exit(main())
