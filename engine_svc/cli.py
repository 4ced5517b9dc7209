"""`tandem-engine`: serve `tandem.engine.v1.EngineCoreService`.

Start-up order matters: TP worker processes are spawned before any gRPC object exists (gRPC core is not
fork-safe); then the server starts with health NOT_SERVING; then the model loads and the KV cache is
allocated on the busy-loop thread, and health turns SERVING. SIGTERM/SIGINT drain; a second one exits
at once. Exit code 0 after a drain, non-zero after a fatal engine error or when the port is taken.
SIGHUP re-reads the TLS certificates and the token file.

It listens on 127.0.0.1 unless --host says otherwise (Kubernetes passes the pod IP). Only frontends
should reach it: give both sides --engine-token-file, and/or serve mutual TLS (--ssl-certfile,
--ssl-keyfile, --ssl-ca-certs); see docs/security.md.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from engine_svc.api.kv_events import DEFAULT_BUFFER as KV_EVENTS_BUFFER
from engine_svc.api.kv_events import DEFAULT_MAX_SUBSCRIBERS
from engine_svc.api.stream_cap import DEFAULT_MAX_TOKENIZER_DOWNLOADS
from engine_svc.config import ConfigError, add_engine_args, config_from_args
from engine_svc.telemetry.stat_logger import DEFAULT_INTERVAL_S, StatLogger
from shared_runtime.link import MAX_MESSAGE_BYTES
from shared_runtime.security.flags import SERVER, add_engine_token_arg, add_tls_args, tls_files
from shared_runtime.security.listen import BindError
from shared_runtime.security.tls import TlsConfigError
from shared_runtime.signals import ServiceSignals, run_main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem-engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default loopback; in Kubernetes the pod IP)")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--metrics-port", type=int, default=9091,
                        help="Prometheus /metrics port, on --host (0 disables)")
    parser.add_argument("--max-waiting", type=int, default=None,
                        help="admission limit: requests the next step cannot seat beyond this many get "
                             "RESOURCE_EXHAUSTED (default: 4 x --max-num-seqs; -1: unbounded)")
    parser.add_argument("--drain-grace-period", type=float, default=45.0,
                        help="seconds in-flight requests may run after SIGTERM before they are aborted")
    parser.add_argument("--max-message-bytes", type=int, default=MAX_MESSAGE_BYTES,
                        help="largest gRPC message sent (queued outputs are split below it) or received; what is "
                             "received is capped lower still, at what an add of max_model_len ids needs "
                             "(5 bytes per id + 64 KiB, at least 4 MiB)")
    parser.add_argument("--health-port", type=int, default=0,
                        help="also serve grpc.health.v1 (only) in plaintext on this port, for probes "
                             "that cannot do TLS (0: off)")
    parser.add_argument("--enable-kv-cache-events", action=argparse.BooleanOptionalAction, default=True,
                        help="record the prefix cache's changes and stream them to frontends (SubscribeKvEvents), "
                             "for cache-aware routing")
    parser.add_argument("--kv-events-buffer", type=int, default=KV_EVENTS_BUFFER,
                        help="KV event batches (about one per step) a subscriber may fall behind before it is "
                             "dropped and must resubscribe")
    parser.add_argument("--max-kv-event-subscribers", type=int, default=DEFAULT_MAX_SUBSCRIBERS,
                        help="SubscribeKvEvents streams open at once (both protocols); more are refused "
                             "RESOURCE_EXHAUSTED")
    parser.add_argument("--max-tokenizer-downloads", type=int, default=DEFAULT_MAX_TOKENIZER_DOWNLOADS,
                        help="GetTokenizer calls served at once (both protocols); more are refused RESOURCE_EXHAUSTED")
    parser.add_argument("--headless", action="store_true",
                        help="a worker node of an engine spanning --nnodes nodes: run this node's workers "
                             "(--node-rank > 0) for node 0's engine, serve no API")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="no periodic stats line (throughput, running/waiting, KV usage, speculative acceptance)")
    parser.add_argument("--log-stats-interval", type=float, default=DEFAULT_INTERVAL_S,
                        help="seconds between stats lines (vLLM's VLLM_LOG_STATS_INTERVAL)")
    security = parser.add_argument_group("security (docs/security.md)")
    add_tls_args(security, side=SERVER, peer="frontends")
    add_engine_token_arg(security, SERVER)
    return parser


def _security(args: argparse.Namespace) -> tuple[object, object]:
    """(ServerTls or None, KeySet or None) from the flags; raises ValueError with the flag's name."""
    from shared_runtime.security.auth import KeySet
    from shared_runtime.security.tls import server_tls

    tls = server_tls(tls_files(args))
    tokens = None
    if args.engine_token_file:
        tokens = KeySet.from_sources((), args.engine_token_file, env_var=None, name="engine token")
    return tls, tokens


def main(argv: list[str] | None = None) -> int:
    return run_main("tandem-engine", lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        for flag in ("kv_events_buffer", "max_kv_event_subscribers", "max_tokenizer_downloads"):
            if getattr(args, flag) < 1:
                raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
        if not args.log_stats_interval > 0:
            raise ConfigError(f"--log-stats-interval must be > 0 seconds, got {args.log_stats_interval}")
        config = config_from_args(args)
        security = _security(args)
    except (ConfigError, TlsConfigError, ValueError) as exc:
        print(f"tandem-engine: {exc}", file=sys.stderr)
        return 2
    if args.headless != (config.node_rank > 0):
        print("tandem-engine: --headless runs the workers of a node with --node-rank > 0; node 0 serves "
              "(drop --headless there)", file=sys.stderr)
        return 2
    if args.headless:
        from engine_svc.executor.headless import run_headless

        return run_headless(config)
    from engine_svc.executor import make_executor

    executor = make_executor(config)  # spawns TP workers now (and waits for headless nodes), before gRPC exists
    try:
        return asyncio.run(_serve(config, args, executor, security))
    except BindError as exc:
        print(f"tandem-engine: {exc}", file=sys.stderr)
        return 1


async def _serve(config, args: argparse.Namespace, executor, security) -> int:
    signals = ServiceSignals()  # first: a signal during start-up is counted, then acted on (signals.py)
    signals.install()
    try:
        return await _serve_with_signals(config, args, executor, security, signals)
    finally:
        signals.remove()


async def _serve_with_signals(config, args: argparse.Namespace, executor, security, signals: ServiceSignals) -> int:
    from engine_svc.api.server import EngineServer
    from engine_svc.telemetry import EngineTelemetry

    tls, tokens = security
    telemetry = EngineTelemetry.from_env(config.model_name, args.metrics_port, args.host)
    server = EngineServer(config, host=args.host, port=args.port, max_waiting=args.max_waiting,
                          drain_grace_s=args.drain_grace_period, executor=executor, telemetry=telemetry,
                          tls=tls, tokens=tokens, health_port=args.health_port,
                          max_message_bytes=args.max_message_bytes, kv_events=args.enable_kv_cache_events,
                          kv_events_buffer=args.kv_events_buffer,
                          max_kv_event_subscribers=args.max_kv_event_subscribers,
                          max_tokenizer_downloads=args.max_tokenizer_downloads, settle_heap_when_ready=True,
                          stat_logger=None if args.disable_log_stats else StatLogger(args.log_stats_interval))
    # The server takes a drain at any point of its start-up (queued until the core is up), so the handlers
    # are bound at once; a signal that came while it was being built is delivered now.
    signals.bind(drain=server.begin_drain, stop=server.force_exit, reload=server.reload_credentials)
    try:
        return max(await server.run(), signals.exit_code)
    finally:
        telemetry.shutdown()  # flush the last spans


if __name__ == "__main__":
    sys.exit(main())
