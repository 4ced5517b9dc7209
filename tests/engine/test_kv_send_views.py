"""The producer's copy-free side-channel send (engine_svc/kv_transfer/blocks.py `cache_views`, source.py
`PullSource.pieces`, side_channel.py `send_views`): views of the cache's own memory are the blocks' wire
bytes (the staging read is the oracle), for any block ids; their CRC-32 sums equal the staged bytes'; a
layout that cannot be sent as it lies falls back to the staging copy; and the send gets every byte across
in order however `sendmsg` cuts it (batches of IOV_MAX buffers, short writes inside a buffer)."""

from __future__ import annotations

import inspect
import itertools
import socket

import pytest
import torch

import engine_svc.kv_transfer.source as source_module
from engine_svc.kv_transfer.blocks import cache_views, read_blocks
from engine_svc.kv_transfer.checksum import span_crcs
from engine_svc.kv_transfer.side_channel import SideChannelServer, receive, send_views
from engine_svc.kv_transfer.source import PullSource


def _caches(num_blocks: int = 20, layers: int = 3, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(2, num_blocks, 4, 2, 8).to(dtype) for _ in range(layers)]


def _source(caches: list[torch.Tensor], block_ids: list[int], views: bool = True) -> PullSource:
    block_bytes = len(read_blocks(caches, [0]))
    return PullSource(lambda ids, out: read_blocks(caches, ids, out), block_ids, block_bytes,
                      views=cache_views(caches) if views else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_views_of_any_blocks_are_their_wire_bytes_and_sums(monkeypatch: pytest.MonkeyPatch,
                                                            dtype: torch.dtype) -> None:
    monkeypatch.setattr(source_module, "blocks_per_span", lambda block_bytes: 3)
    caches = _caches(dtype=dtype)
    block_ids = [7, 2, 19, 3, 4, 11, 0, 5]  # out of order, a consecutive run, both ends of the cache
    whole = bytes(read_blocks(caches, block_ids))
    source = _source(caches, block_ids)
    spans = [list(views) for views in source.pieces()]
    assert [sum(len(v) for v in views) for views in spans] == [3 * source.block_bytes] * 2 + [2 * source.block_bytes]
    assert all(view.obj is not None and not isinstance(view.obj, bytes) for views in spans for view in views)
    assert b"".join(bytes(v) for views in spans for v in views) == whole
    assert source.crcs == span_crcs(whole, source.span_bytes)


def test_views_are_the_cache_itself_not_a_copy() -> None:
    caches = _caches()
    views = cache_views(caches)
    assert views is not None
    first = views([6])[0]
    caches[0][0, 6].fill_(1.5)
    assert bytes(first) == caches[0][0, 6].numpy().tobytes()
    with pytest.raises(IndexError, match="block 20 is not in a cache of 20 blocks"):
        views([1, 20])


def test_a_layout_that_cannot_be_sent_as_it_lies_falls_back_to_the_staging_copy() -> None:
    """A layer tensor that is not contiguous (here: a transposed view), shaped unlike the first, or not in
    host memory: no views, and the spans are the staging buffer's bytes, as before."""
    caches = _caches()
    strided = [c.transpose(3, 4).contiguous().transpose(3, 4) for c in caches]  # same values, other strides
    assert cache_views(strided) is None
    assert cache_views([caches[0], torch.randn(2, 20, 4, 2, 4)]) is None
    assert cache_views([]) is None
    assert cache_views([torch.empty(2, 20, 4, 2, 8, device="meta")]) is None  # not in host memory (a GPU's cache)
    block_ids = [9, 1, 4]
    source = PullSource(lambda ids, out: read_blocks(strided, ids, out), block_ids,
                        len(read_blocks(strided, [0])), views=cache_views(strided))
    spans = [[bytes(v) for v in views] for views in source.pieces()]
    assert all(len(views) == 1 for views in spans)  # one staged span each
    assert b"".join(b"".join(views) for views in spans) == bytes(read_blocks(caches, block_ids))


def test_a_stopped_source_sends_no_further_span(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(source_module, "blocks_per_span", lambda block_bytes: 1)
    caches = _caches()
    source = _source(caches, [1, 2, 3, 4])
    spans = source.pieces()
    next(spans)
    source.stop()
    assert list(spans) == []
    assert source.crcs == span_crcs(bytes(read_blocks(caches, [1])), source.span_bytes)


class _ShortWrites:
    """A socket whose sendmsg takes at most `most` bytes and records how many buffers each call got."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.got = bytearray()
        self.batches: list[int] = []

    def sendmsg(self, buffers: list[memoryview]) -> int:
        self.batches.append(len(buffers))
        taken = b"".join(bytes(b) for b in buffers)[:self.most]
        self.got += taken
        return len(taken)


@pytest.mark.parametrize("most", [1, 7, 13, 64, 10_000])
def test_every_byte_goes_in_order_across_batches_and_short_writes(most: int) -> None:
    data = bytes(range(256)) * 2
    cuts = [0, 5, 5, 17, 40, 41, 100, 256, 300, 511, 512]  # an empty view, one-byte views, uneven sizes
    views = [memoryview(data)[a:b] for a, b in itertools.pairwise(cuts)]
    sock = _ShortWrites(most)
    send_views(sock, views, iov_max=3)  # type: ignore[arg-type]
    assert bytes(sock.got) == data
    assert max(sock.batches) <= 3 and len(sock.batches) >= -(-len(views) // 3)


def test_a_peer_that_takes_nothing_is_an_error() -> None:
    sock = _ShortWrites(0)
    with pytest.raises(ConnectionError, match="took no bytes"):
        send_views(sock, [memoryview(b"abc")])  # type: ignore[arg-type]
    send_views(sock, [memoryview(b""), memoryview(b"")])  # type: ignore[arg-type]  # nothing to send: fine


def test_a_pull_of_views_over_the_side_channel_arrives_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Real sockets: a pull of more buffers than one sendmsg takes, received and summed as the consumer does."""
    import engine_svc.kv_transfer.side_channel as side_module
    from engine_svc.kv_transfer.checksum import SpanSums, first_mismatch

    monkeypatch.setattr(side_module.send_views, "__defaults__", (5,))  # IOV_MAX of 5: many sendmsg calls a span
    caches = _caches(num_blocks=40)
    block_ids = list(range(39, -1, -2))
    source = _source(caches, block_ids)
    server = SideChannelServer("127.0.0.1", 0)
    try:
        ticket, transfer = server.offer(source.pieces())
        buffer = memoryview(bytearray(source.size))
        with SpanSums(buffer, source.span_bytes) as sums:
            receive("127.0.0.1", server.port, ticket, buffer, 10, sums)
        assert transfer.done.wait(10) and transfer.error is None
        assert bytes(buffer) == bytes(read_blocks(caches, block_ids))
        assert first_mismatch(sums.crcs, source.crcs, source.span_bytes, source.size) is None
    finally:
        server.close()


def test_a_cut_connection_ends_the_send_with_an_error() -> None:
    """The consumer goes away mid-pull: the producer's send fails (the transfer says why) instead of hanging."""
    caches = [torch.zeros(2, 200, 16, 4, 64) for _ in range(4)]  # 25 MiB: more than the sockets buffer
    source = _source(caches, list(range(200)))
    server = SideChannelServer("127.0.0.1", 0)
    try:
        ticket, transfer = server.offer(source.pieces())
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
            conn.sendall(ticket)
            conn.recv(1000)
        assert transfer.done.wait(10) and transfer.error is not None
    finally:
        server.close()


def test_a_failed_send_closes_the_source_on_the_sending_thread() -> None:
    """The producer's iteration ends (closed) when the send fails, before `done` is set - not whenever the
    transfer is dropped, on whatever thread drops it."""
    caches = [torch.zeros(2, 200, 16, 4, 64) for _ in range(4)]
    source = _source(caches, list(range(200)))
    pieces = source.pieces()
    server = SideChannelServer("127.0.0.1", 0)
    try:
        ticket, transfer = server.offer(pieces)
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
            conn.sendall(ticket)
            conn.recv(1000)
        assert transfer.done.wait(10) and transfer.error is not None
        assert inspect.getgeneratorstate(pieces) == inspect.GEN_CLOSED
    finally:
        server.close()


def test_the_staging_read_uses_the_connectors_host_buffer_once_per_pull() -> None:
    """The staging path (a device cache: no views) gathers every span into one buffer from `host_buffer`
    (blocks.staging_buffer: pinned for a CUDA cache, tests/gpu/test_kv_transfer_gpu.py), reused span after
    span; on a CPU cache that buffer is plain host memory."""
    from engine_svc.kv_transfer.blocks import staging_buffer

    caches = _caches()
    block_ids = [7, 2, 19, 3, 4, 11, 0, 5]
    block_bytes = len(read_blocks(caches, [0]))
    asked: list[memoryview] = []

    def host_buffer(nbytes: int) -> memoryview:
        asked.append(staging_buffer(nbytes, torch.device("cpu")))
        return asked[-1]

    source = PullSource(lambda ids, out: read_blocks(caches, ids, out), block_ids, block_bytes,
                        host_buffer=host_buffer)
    spans = [bytes(span) for span in source]
    assert b"".join(spans) == bytes(read_blocks(caches, block_ids))
    assert len(asked) == 1 and len(asked[0]) == source.span_bytes
    assert not torch.frombuffer(asked[0], dtype=torch.uint8).is_pinned()
