"""Build an engine's connector from its config and its (allocated) KV cache."""

from __future__ import annotations

import grpc

from engine_svc.config import ConfigError, EngineConfig
from engine_svc.executor.base import Executor
from engine_svc.executor.uniproc import UniprocExecutor
from engine_svc.kv_transfer.blocks import layout_of
from engine_svc.kv_transfer.connector import KVConnector
from engine_svc.kv_transfer.leases import LeaseTable
from engine_svc.kv_transfer.puller import KVPuller
from shared_runtime.link import MAX_MESSAGE_BYTES
from shared_runtime.security.auth import BearerToken
from shared_runtime.security.tls import TlsFiles


def make_connector(config: EngineConfig, executor: Executor) -> KVConnector:
    """The connector of an engine started with --kv-transfer-config (single device: the cache lives in
    this process). Its engine id, address and pull credentials are set by the server once it listens."""
    kv_config = config.kv_transfer_config
    assert kv_config is not None
    if not isinstance(executor, UniprocExecutor):
        raise ConfigError("--kv-transfer-config needs the in-process executor (--tensor-parallel-size 1)")
    kv_caches = executor.worker.runner.kv_caches  # type: ignore[union-attr]
    layout = layout_of(kv_caches, config.model_name, config.block_size, config.tensor_parallel_size)
    connector = KVConnector(
        kv_config, config.block_size,
        leases=LeaseTable(kv_config.kv_lease_duration_s),
        puller=KVPuller(layout, timeout_s=kv_config.kv_pull_timeout_s, max_message_bytes=MAX_MESSAGE_BYTES))
    connector.kv_caches, connector.layout = kv_caches, layout
    return connector


def advertise(connector: KVConnector, engine_id: str, host: str, port: int, token_file: str | None,
              tls: TlsFiles | None = None) -> None:
    """What the server tells the connector once it listens: the engine id and address its kept blocks are
    pulled from (`kv_advertise_host` overrides a wildcard bind host), the engine token its pulls present
    (engines of one deployment share it), and the TLS its pulls use (`pull_credentials`)."""
    connector.engine_id, connector.port = engine_id, port
    if not connector.host:
        connector.host = "127.0.0.1" if host in ("", "0.0.0.0", "::", "[::]") else host
    if token_file is not None and connector.puller is not None:
        token = BearerToken(token_file)
        connector.puller.authorization = lambda: token.header
    if tls is not None and tls.enabled and connector.puller is not None:
        connector.puller.credentials = lambda: pull_credentials(tls)
        connector.puller.ssl_server_name = connector.config.kv_ssl_server_name


def pull_credentials(tls: TlsFiles) -> grpc.ChannelCredentials:
    """The pull's TLS when this engine serves TLS: engines of one deployment serve the same way, so the
    producer does too. Its CA bundle (--ssl-ca-certs) verifies the producer (the system's roots without
    one), and its own certificate is the client certificate a producer under mutual TLS requires (so, under
    mutual TLS, engine certificates carry the client-auth usage too). Re-read per pull: rotation applies."""
    cert, key, ca = tls.read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
