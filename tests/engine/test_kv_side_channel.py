"""The pull's side channel (engine_svc/kv_transfer/side_channel.py): a producer with
`kv_side_channel_port` sends a plaintext consumer the bytes over plain TCP, gRPC keeping the control.

Exact against one engine like the gRPC path (tests/engine/test_kv_transfer.py), the bytes really take the
side channel, a corrupted transfer is refused by its spans' CRC-32 and recomputed, a wrong ticket gets nothing, a
pull over TLS never offers it, and an engine serving TLS refuses the key at start.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from tandem.engine.v1 import engine_core_pb2 as epb
from tandem.engine.v1 import engine_core_pb2_grpc as epb_grpc

from engine_svc.config import ConfigError
from engine_svc.core import EngineCore
from engine_svc.kv_transfer.checksum import SpanSums, span_crcs
from engine_svc.kv_transfer.config import KVTransferConfig
from engine_svc.kv_transfer.puller import layout_to_pb
from engine_svc.kv_transfer.side_channel import TICKET_BYTES
from shared_runtime.contract import EngineCoreRequest, EngineSamplingParams
from tests.engine.test_engine_server import ServerThread
from tests.engine.test_kv_transfer import (
    GREEDY,
    PROMPT,
    _all_free,
    _assert_close,
    _config,
    _consumer,
    _decode_request,
    _prefill,
    _run,
    _serve,
    _stop,
    check_corrupted_pull_is_recomputed,
)
from tests.engine_stream import engine_idle
from tests.support import wait_until


@pytest.fixture(scope="module")
def side_producer(llama_dir: Path) -> Iterator[ServerThread]:
    running = _serve(_config(llama_dir, KVTransferConfig(kv_role="kv_producer", kv_side_channel_port=0)))
    yield running
    _stop(running)


def _side(producer: ServerThread) -> object:
    side = producer.server.servicer.core.kv_connector.side_channel  # type: ignore[union-attr]
    assert side is not None
    return side


@pytest.fixture(scope="module")
def one_engine(llama_dir: Path) -> EngineCore:
    """One engine without P/D: the oracle."""
    return EngineCore(_config(llama_dir))


def test_the_bytes_take_the_side_channel_and_the_output_is_exact(side_producer: ServerThread,
                                                                 one_engine: EngineCore, llama_dir: Path) -> None:
    want, want_logprobs, _ = _run(one_engine, EngineCoreRequest(
        request_id="u-side", prompt_token_ids=PROMPT, sampling_params=EngineSamplingParams(**GREEDY)))
    side = _side(side_producer)
    sent_before = side.num_sent  # type: ignore[attr-defined]
    # a one-rank cache in host memory: sent from the cache itself (the staging copy is tests/engine/test_kv_transfer.py's)
    assert side_producer.server.servicer.core.kv_connector.block_views is not None  # type: ignore[union-attr]
    first = _prefill(side_producer, "p-side", PROMPT, GREEDY)
    consumer = _consumer(llama_dir)
    try:
        rest, rest_logprobs, _ = _run(consumer, _decode_request("d-side", PROMPT, GREEDY, first))
        assert list(first.new_token_ids) + rest == want
        _assert_close(list(first.new_logprobs) + rest_logprobs, want_logprobs)
        connector = consumer.kv_connector
        assert connector is not None and (connector.num_blocks_pulled, connector.num_pull_failures) == (5, 0)
        assert side.num_sent == sent_before + 1  # type: ignore[attr-defined]
        assert _all_free(consumer)
    finally:
        consumer.shutdown()
    wait_until(lambda: engine_idle(side_producer.address), 15, "the producer's blocks freed after the pull")


def test_a_corrupted_side_transfer_is_refused_and_recomputed(side_producer: ServerThread, one_engine: EngineCore,
                                                             llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    check_corrupted_pull_is_recomputed(side_producer, one_engine, llama_dir, monkeypatch, "side-bad")


def test_a_wrong_ticket_gets_nothing_and_the_right_one_works_once(side_producer: ServerThread) -> None:
    _prefill(side_producer, "p-ticket", PROMPT, GREEDY)
    layout = layout_to_pb(side_producer.server.servicer.core.kv_connector.layout)  # type: ignore[union-attr]
    port = _side(side_producer).port  # type: ignore[attr-defined]
    with side_producer.channel() as channel:
        call = epb_grpc.EngineCoreServiceStub(channel).PullKvBlocks(
            epb.PullKvBlocksRequest(request_id="p-ticket", layout=layout, accept_side_channel=True), timeout=20)
        first = next(call)
        assert first.side_port == port and len(first.side_ticket) == TICKET_BYTES and not first.data
        assert _side_read(port, bytes(TICKET_BYTES)) == b""  # closed unread
        size = first.num_blocks * side_producer.server.servicer.core.kv_connector.layout.block_bytes  # type: ignore[union-attr]
        data = _side_read(port, first.side_ticket)
        assert len(data) == size and first.checksum_span_bytes > 0
        assert _side_read(port, first.side_ticket) == b""  # used
        last = next(call)
        assert list(last.span_crc32) == span_crcs(data, first.checksum_span_bytes) and not last.data
    wait_until(lambda: engine_idle(side_producer.address), 15, "the pull ended the lease")


def _side_read(port: int, ticket: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(ticket)
        parts = []
        while chunk := conn.recv(1 << 20):
            parts.append(chunk)
    return b"".join(parts)


def test_tls_and_the_side_channel_do_not_mix(llama_dir: Path, tmp_path: Path) -> None:
    """A pull over TLS never offers the side channel; an engine serving TLS refuses the key at start."""
    from engine_svc.kv_transfer.puller import KVPuller
    from engine_svc.kv_transfer.setup import advertise
    from shared_runtime.security.tls import TlsFiles

    core = EngineCore(_config(llama_dir, KVTransferConfig(kv_role="kv_both", kv_side_channel_port=0)))
    try:
        connector = core.kv_connector
        assert connector is not None
        tls = TlsFiles(certfile=str(tmp_path / "c.pem"), keyfile=str(tmp_path / "k.pem"))
        with pytest.raises(ConfigError, match="kv_side_channel_port: the side channel is plain TCP"):
            advertise(connector, "e", "127.0.0.1", 1, None, tls)
        assert connector.side_channel is None
    finally:
        core.shutdown()
    puller = KVPuller(connector.layout, timeout_s=5, max_message_bytes=1 << 20)  # type: ignore[arg-type]
    puller.credentials = lambda: grpc.ssl_channel_credentials()
    assert puller._request("x", 0, "").accept_side_channel is False
    puller.credentials = None
    assert puller._request("x", 0, "").accept_side_channel is True


def test_a_ticket_is_good_for_one_connection_until_withdrawn() -> None:
    """The server alone: a ticket serves one connection (a second gets nothing even before the pull's stream
    ends), and a withdrawn ticket serves none."""
    from engine_svc.kv_transfer.side_channel import SideChannelServer, receive

    server = SideChannelServer("127.0.0.1", 0)
    try:
        data = bytes(range(256)) * 1000
        ticket, transfer = server.offer([data[:1000], memoryview(data)[1000:]])
        buffer = memoryview(bytearray(len(data)))
        with SpanSums(buffer, 4096) as sums:
            receive("127.0.0.1", server.port, ticket, buffer, 10, sums)
        assert buffer == data and sums.crcs == span_crcs(data, 4096)
        assert transfer.done.wait(10) and transfer.error is None and server.num_sent == 1
        assert _side_read(server.port, ticket) == b""  # used
        server.withdraw(ticket)
        late, _ = server.offer(data)
        server.withdraw(late)
        assert _side_read(server.port, late) == b""
        with pytest.raises(ValueError, match="closed after 0 of"):
            receive("127.0.0.1", server.port, late, memoryview(bytearray(len(data))), 10)
    finally:
        server.close()
