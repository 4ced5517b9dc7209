"""`tandem-frontend`: serve `tandem.v1.GenerationService` in front of one or more engines.

  tandem-frontend --engine host:port[,host:port...] [--port 50050]
  tandem-frontend --engine dns:///tandem-engine.ns.svc.cluster.local:50051
  tandem-frontend --model DIR --engine host:port

Without --model the tokenizer files, chat template and config.json come from the engines (GetTokenizer):
every engine that answers at start must serve the same files, or the frontend refuses to start, naming
the engines and the files that differ; an engine joining later with other files is not routed to. With
--model the directory (or .gguf file) is read for its tokenizer and config.json only.

Routing (--routing): cache-aware (the default with several engines or a dns:/// target) follows every
engine's KV-cache events and sends a request to the engine holding the longest prefix of its prompt,
unless the load is imbalanced (SGLang's cache_aware thresholds: --cache-threshold,
--balance-abs-threshold, --balance-rel-threshold); least-load (the default for one host:port); prefix. Health turns SERVING once an
engine serving the same vocabulary is connected. SIGTERM/SIGINT drain (new calls get UNAVAILABLE,
running ones may finish within --drain-grace-period) and exit 0; a second signal stops at once and
exits 1. SIGHUP re-reads the TLS certificates and the API key file (docs/security.md).

Security: --ssl-certfile/--ssl-keyfile serve TLS (with --ssl-ca-certs: clients must present a
certificate from that CA); --api-key (repeatable), --api-key-file or $TANDEM_API_KEY require
`authorization: Bearer <key>` on every call but health; --engine-ssl-* and --engine-token-file secure
the link to the engines. A port that is taken is an error (exit 1), never shared.

OpenAI-compatible HTTP API: --http-port serves /v1/completions, /v1/chat/completions, /v1/models and
/health on its own port (off by default; `tandem serve` turns it on), with the same API keys and TLS
files as the gRPC port, and drains with it (docs/openai.md).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import shutil
import sys
from pathlib import Path

from frontend_svc.config import (
    ROUTING_POLICIES,
    ConfigError,
    FrontendConfig,
    default_routing,
    parse_engine_list,
)
from frontend_svc.engines.router import CacheAwareSettings
from frontend_svc.openai.tool_parsers import TOOL_CALL_PARSER_NAMES
from shared_runtime.heap import settle_heap
from shared_runtime.security.auth import API_KEY_ENV
from shared_runtime.security.flags import (
    API_KEY_FLAG_WARNING,
    CLIENT,
    SERVER,
    add_api_key_args,
    add_engine_token_arg,
    add_tls_args,
    tls_files,
)
from shared_runtime.security.http_limits import add_http_limit_args, http_limits_from_args, raise_fd_limit
from shared_runtime.security.listen import BindError
from shared_runtime.security.tls import TlsConfigError
from shared_runtime.signals import ServiceSignals, run_main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem-frontend", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="model directory or .gguf file (tokenizer files + config.json); default: fetch them "
                        "from the engines")
    p.add_argument("--engine", default="127.0.0.1:50051",
                   help="engine targets: host:port[,host:port...] or dns:///name:port (all A records)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=50050)
    p.add_argument("--metrics-port", type=int, default=9090, help="Prometheus /metrics port (0 disables)")
    p.add_argument("--max-concurrent-requests", type=int, default=512,
                   help="completions in flight (a Generate call with n counts n); beyond this "
                        "RESOURCE_EXHAUSTED")
    defaults = CacheAwareSettings()
    p.add_argument("--routing", choices=ROUTING_POLICIES, default=None,
                   help="default: cache-aware with several engines or a dns:/// target, else least-load")
    p.add_argument("--cache-threshold", type=float, default=defaults.cache_threshold,
                   help="cache-aware: route to the engine with the longest cached prefix only when it covers "
                        "more than this fraction of the prompt (else to the least loaded)")
    p.add_argument("--balance-abs-threshold", type=int, default=defaults.balance_abs_threshold,
                   help="cache-aware: an engine is overloaded (the request goes to the least loaded instead) "
                        "when it has more than this many requests more than the least-loaded engine ... "
                        "(default: a quarter of the engine's --max-num-seqs)")
    p.add_argument("--balance-rel-threshold", type=float, default=defaults.balance_rel_threshold,
                   help="... and more than this times its load")
    p.add_argument("--tokenizer-fetch-timeout", type=float, default=600.0,
                   help="without --model: seconds to wait at start for an engine to serve its tokenizer")
    p.add_argument("--drain-grace-period", type=float, default=45.0,
                   help="seconds running calls may continue after SIGTERM")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="cap the context window (default: the engines' / config.json's)")
    p.add_argument("--max-message-bytes", type=int, default=4 * 1024 * 1024,
                   help="largest request message accepted (larger: RESOURCE_EXHAUSTED)")
    p.add_argument("--tokenizer-threads", type=int, default=0,
                   help="threads that tokenize and render chats off the event loop (0: min(4, CPUs))")
    p.add_argument("--health-port", type=int, default=0,
                   help="also serve grpc.health.v1 (only) in plaintext on this port, for probes that "
                        "cannot do TLS (0: off)")
    p.add_argument("--http-port", type=int, default=0,
                   help="also serve the OpenAI-compatible HTTP API on this port (0: off; docs/openai.md)")
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSER_NAMES, default=None,
                   help="the model's tool-call format, for OpenAI tool_choice 'auto' (vLLM's flag; "
                        "docs/openai.md); without it 'auto' is refused")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a chat request's own `chat_template` (vLLM's flag). A template is code: even in "
                        "jinja2's sandbox one request can loop for minutes, so only for trusted clients")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="stream each completion in chunks of at least this many tokens (vLLM's flag; the first "
                        "and last chunks go out at once; a request's stream_interval may raise it)")
    p.add_argument("--max-migrations", type=int, default=3,
                   help="times a request may move to another engine when its engine dies or drains (its stream "
                        "goes on where it was; 0: off, the request ends with UNAVAILABLE; docs/architecture.md)")
    p.add_argument("--migration-timeout", type=float, default=10.0,
                   help="seconds a moving request waits for a ready engine before it ends with UNAVAILABLE")
    p.add_argument("--log-level", default="INFO")
    add_http_limit_args(p.add_argument_group("HTTP API limits (docs/security.md)"))
    add_security_args(p)
    return p


def add_security_args(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("security (docs/security.md)")
    add_tls_args(s, side=SERVER, peer="clients")
    add_api_key_args(s)
    add_tls_args(s, "--engine-ssl", side=CLIENT, peer="engines")
    s.add_argument("--engine-ssl-server-name", default=None,
                   help="the name the engines' certificates carry (default: the host of --engine, e.g. "
                        "the DNS name of a dns:/// target)")
    add_engine_token_arg(s, CLIENT)


def config_from_args(args: argparse.Namespace) -> FrontendConfig:
    try:
        http_limits = http_limits_from_args(args)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    engines = parse_engine_list(args.engine)
    return FrontendConfig(
        model=args.model, engines=engines, host=args.host, port=args.port,
        metrics_port=args.metrics_port, max_concurrent_requests=args.max_concurrent_requests,
        routing=args.routing or default_routing(engines), drain_grace_s=args.drain_grace_period,
        cache_aware=CacheAwareSettings(args.cache_threshold, args.balance_abs_threshold,
                                       args.balance_rel_threshold),
        tokenizer_fetch_timeout_s=args.tokenizer_fetch_timeout,
        served_model_name=args.served_model_name, max_model_len=args.max_model_len,
        max_message_bytes=args.max_message_bytes, tokenizer_threads=args.tokenizer_threads,
        health_port=args.health_port, http_port=args.http_port, http_limits=http_limits,
        tool_call_parser=args.tool_call_parser, trust_request_chat_template=args.trust_request_chat_template,
        stream_interval=args.stream_interval,
        max_migrations=args.max_migrations, migration_timeout_s=args.migration_timeout,
        tls=tls_files(args), engine_tls=tls_files(args, "--engine-ssl"),
        api_keys=tuple(args.api_key) + _env_keys(), api_key_file=args.api_key_file,
        engine_token_file=args.engine_token_file, engine_ssl_server_name=args.engine_ssl_server_name,
    )


def _env_keys() -> tuple[str, ...]:
    key = os.environ.get(API_KEY_ENV, "").strip()
    return (key,) if key else ()


def main(argv: list[str] | None = None) -> int:
    return run_main("tandem-frontend", lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.api_key:
        logging.getLogger("tandem-frontend").warning(API_KEY_FLAG_WARNING)
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"tandem-frontend: {exc}", file=sys.stderr)
        return 2
    raise_fd_limit()  # every client connection is a descriptor; the usual soft limit of 1024 is soon spent
    return asyncio.run(_serve(config))


async def _serve(config: FrontendConfig) -> int:
    signals = ServiceSignals()  # first: a signal during start-up is counted, then acted on (signals.py)
    signals.install()
    try:
        return await _fetch_and_serve(config, signals)
    finally:
        signals.remove()


async def _fetch_and_serve(config: FrontendConfig, signals: ServiceSignals) -> int:
    fetched_dir = None
    if config.model is None:
        try:
            config, fetched_dir = await _with_engine_tokenizer(config)
        except (ConfigError, ValueError) as exc:
            print(f"tandem-frontend: {exc}", file=sys.stderr)
            return 2
    try:
        return await _serve_with_model(config, signals)
    finally:
        if fetched_dir is not None:
            shutil.rmtree(fetched_dir, ignore_errors=True)


async def _with_engine_tokenizer(config: FrontendConfig) -> tuple[FrontendConfig, Path]:
    """The config with the engines' tokenizer files as its model (written to a temporary directory, which
    is returned too); raises TokenizerFetchError (a ValueError) or ConfigError."""
    from frontend_svc.engines.client import ChannelFactory
    from frontend_svc.tokenizer_fetch import TokenizerFetchError, fetch_engine_tokenizer, write_tokenizer_dir
    from shared_runtime.security.auth import BearerToken
    from shared_runtime.security.tls import client_tls

    token = BearerToken(config.engine_token_file) if config.engine_token_file else None
    channels = ChannelFactory(client_tls(config.engine_tls), token, config.engine_ssl_server_name)
    try:
        fetched = await fetch_engine_tokenizer(config.engines, channels, config.tokenizer_fetch_timeout_s)
    except TokenizerFetchError as exc:
        raise ValueError(str(exc)) from None
    model = write_tokenizer_dir(fetched)
    directory = model.parent if fetched.is_gguf else model
    try:
        return dataclasses.replace(config, model=str(model), engine_tokenizer_sha256=fetched.sha256,
                                   served_model_name=config.served_model_name or fetched.model_name), directory
    except ConfigError:
        shutil.rmtree(directory, ignore_errors=True)
        raise


async def _serve_with_model(config: FrontendConfig, signals: ServiceSignals) -> int:
    from frontend_svc.server import FrontendServer
    from frontend_svc.telemetry.service import FrontendTelemetry

    telemetry = FrontendTelemetry.from_env(config.model_name, config.metrics_port, config.host)
    try:
        server = FrontendServer(config, telemetry=telemetry)
    except (ValueError, TlsConfigError) as exc:  # e.g. a key or token file that holds no key
        print(f"tandem-frontend: {exc}", file=sys.stderr)
        telemetry.shutdown()
        return 2
    try:
        if signals.stopping:  # stopped while starting: nothing to serve or drain
            return signals.exit_code
        await server.start()
        signals.bind(drain=server.drain, stop=server.stop, reload=server.reload_credentials)
        settle_heap()  # after start-up: the tokenizer, templates and libraries are what the heap holds
        await server.wait_stopped()
    except BindError as exc:
        print(f"tandem-frontend: {exc}", file=sys.stderr)
        await server.stop()
        return 1
    finally:
        telemetry.shutdown()  # flush the last spans
    return signals.exit_code


if __name__ == "__main__":
    sys.exit(main())
