"""Build an engine's connector from its config and its (allocated) KV cache."""

from __future__ import annotations

import functools
from typing import Protocol, runtime_checkable

import grpc

from engine_svc.config import ConfigError, EngineConfig
from engine_svc.executor.base import Executor
from engine_svc.executor.uniproc import UniprocExecutor
from engine_svc.kv_transfer.blocks import BlockViews, cache_views, read_blocks, staging_buffer
from engine_svc.kv_transfer.connector import KVConnector
from engine_svc.kv_transfer.leases import LeaseTable
from engine_svc.kv_transfer.puller import KVPuller
from engine_svc.kv_transfer.shards import decode_shards, describe, layout_of
from engine_svc.kv_transfer.side_channel import SideChannelServer
from engine_svc.kv_transfer.source import HostBuffer
from shared_runtime.link import MAX_MESSAGE_BYTES
from shared_runtime.security.auth import BearerToken
from shared_runtime.security.tls import TlsFiles


@runtime_checkable
class ShardedKVExecutor(Protocol):
    """An executor whose ranks hold the K/V (multiproc, Ray): they answer KV_DESCRIBE and KV_READ."""

    def describe_kv(self) -> bytes: ...

    def read_kv_blocks(self, block_ids: list[int]) -> bytes: ...


def make_connector(config: EngineConfig, executor: Executor) -> KVConnector:
    """The connector of an engine started with --kv-transfer-config. Its engine id, address and pull
    credentials are set by the server once it listens.

    One device: the cache lives in this process, and a pull reads it directly (over the side channel,
    from host memory, without a copy: blocks.cache_views). Several ranks (TP/PP, the
    multiprocessing or the Ray executor): the ranks learn every rank's shard now (KV_DESCRIBE), and a pull
    asks them for the blocks (KV_READ, gathered to the answer rank: shards.py), in step order."""
    kv_config = config.kv_transfer_config
    assert kv_config is not None
    views: BlockViews | None = None
    host_buffer: HostBuffer = staging_buffer  # a span's staging memory, on the producer
    if isinstance(executor, UniprocExecutor):
        worker = executor.worker
        assert worker.runner is not None
        shards = describe(worker.runner.kv_caches, worker.model)
        worker.kv_shards, worker.kv_shard = shards, None
        kv_caches = worker.runner.kv_caches

        def read(block_ids: list[int], out: memoryview | None) -> bytes | memoryview:
            return read_blocks(kv_caches, block_ids, out)

        views = cache_views(kv_caches)  # None on a device: the side channel sends staged copies
        host_buffer = functools.partial(staging_buffer, device=kv_caches[0].device)  # pinned on CUDA
    elif isinstance(executor, ShardedKVExecutor):
        shards = decode_shards(executor.describe_kv())

        def read(block_ids: list[int], out: memoryview | None) -> bytes | memoryview:
            return executor.read_kv_blocks(block_ids)  # the answer rank's bytes; `out` unused
    else:
        raise ConfigError(f"--kv-transfer-config cannot run under the {type(executor).__name__}: use the "
                          "in-process executor (one device) or --distributed-executor-backend mp or ray")
    layout = layout_of(shards, config.model_name, config.block_size, config.tensor_parallel_size)
    connector = KVConnector(
        kv_config, config.block_size,
        leases=LeaseTable(kv_config.kv_lease_duration_s),
        puller=KVPuller(layout, timeout_s=kv_config.kv_pull_timeout_s, max_message_bytes=MAX_MESSAGE_BYTES))
    connector.read_blocks, connector.layout = read, layout
    connector.reads_in_pieces = isinstance(executor, UniprocExecutor)  # a read of ranks is a command to them
    connector.block_views, connector.host_buffer = views, host_buffer
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
    side_port = connector.config.kv_side_channel_port
    if side_port >= 0 and connector.leases is not None:
        if tls is not None and tls.enabled:
            raise ConfigError("kv_transfer_config.kv_side_channel_port: the side channel is plain TCP, and this "
                              "engine serves TLS: drop the key (pulls then stay in the TLS stream)")
        connector.side_channel = SideChannelServer(host, side_port)


def pull_credentials(tls: TlsFiles) -> grpc.ChannelCredentials:
    """The pull's TLS when this engine serves TLS: engines of one deployment serve the same way, so the
    producer does too. Its CA bundle (--ssl-ca-certs) verifies the producer (the system's roots without
    one), and its own certificate is the client certificate a producer under mutual TLS requires (so, under
    mutual TLS, engine certificates carry the client-auth usage too). Re-read per pull: rotation applies."""
    cert, key, ca = tls.read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
