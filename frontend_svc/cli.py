"""`tandem-frontend`: serve `tandem.v1.GenerationService` in front of one or more engines.

  tandem-frontend --model DIR --engine host:port[,host:port...] [--port 50050]
  tandem-frontend --model DIR --engine dns:///tandem-engine.ns.svc.cluster.local:50051

The model directory is read for its tokenizer and config.json only. Health turns SERVING once an
engine serving the same vocabulary is connected. SIGTERM/SIGINT drain (new calls get UNAVAILABLE,
running ones may finish within --drain-grace-period) and exit 0; a second signal exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from frontend_svc.config import ROUTING_POLICIES, ConfigError, FrontendConfig, parse_engine_list


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem-frontend", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model directory (tokenizer files + config.json)")
    p.add_argument("--engine", default="127.0.0.1:50051",
                   help="engine targets: host:port[,host:port...] or dns:///name:port (all A records)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=50050)
    p.add_argument("--metrics-port", type=int, default=9090, help="Prometheus /metrics port (0 disables)")
    p.add_argument("--max-concurrent-requests", type=int, default=512,
                   help="Generate calls in flight; beyond this RESOURCE_EXHAUSTED")
    p.add_argument("--routing", choices=ROUTING_POLICIES, default="least-load")
    p.add_argument("--drain-grace-period", type=float, default=45.0,
                   help="seconds running calls may continue after SIGTERM")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="cap the context window (default: the engines' / config.json's)")
    p.add_argument("--max-message-bytes", type=int, default=4 * 1024 * 1024,
                   help="largest request message accepted (larger: RESOURCE_EXHAUSTED)")
    p.add_argument("--log-level", default="INFO")
    return p


def config_from_args(args: argparse.Namespace) -> FrontendConfig:
    return FrontendConfig(
        model=args.model, engines=parse_engine_list(args.engine), host=args.host, port=args.port,
        metrics_port=args.metrics_port, max_concurrent_requests=args.max_concurrent_requests,
        routing=args.routing, drain_grace_s=args.drain_grace_period,
        served_model_name=args.served_model_name, max_model_len=args.max_model_len,
        max_message_bytes=args.max_message_bytes,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"tandem-frontend: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_serve(config))


async def _serve(config: FrontendConfig) -> int:
    from frontend_svc.server import FrontendServer
    from frontend_svc.telemetry.service import FrontendTelemetry

    telemetry = FrontendTelemetry.from_env(config.model_name, config.metrics_port, config.host)
    server = FrontendServer(config, telemetry=telemetry)
    loop = asyncio.get_running_loop()
    signals = {"count": 0}
    tasks: list[asyncio.Task[None]] = []

    def on_signal() -> None:
        signals["count"] += 1
        if signals["count"] == 1:
            tasks.append(loop.create_task(server.drain()))
        else:
            tasks.append(loop.create_task(server.stop()))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    try:
        await server.start()
        await server.wait_stopped()
    finally:
        telemetry.shutdown()  # flush the last spans
    return 0


if __name__ == "__main__":
    sys.exit(main())
