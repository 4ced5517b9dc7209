"""A pull's integrity check and the producer's span-by-span reads (engine_svc/kv_transfer/checksum.py,
source.py, blocks.py): the consumer's sums, computed while bytes arrive in pieces of any size, equal the
producer's; a flipped bit, swapped spans, or a missing span are refused, naming where; the spans a
producer reads one by one into its staging buffer are the blocks' wire bytes; and pulled bytes are
written into the cache the same from a writable buffer (in place) or read-only bytes (copied)."""

from __future__ import annotations

import random

import numpy
import pytest
import torch

import engine_svc.kv_transfer.source as source_module
from engine_svc.kv_transfer.blocks import read_blocks, write_blocks
from engine_svc.kv_transfer.checksum import SpanSums, blocks_per_span, first_mismatch, span_crcs
from engine_svc.kv_transfer.source import PullSource

SPAN = 1000


def _random_bytes(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def _sums_as_arriving(data: bytes, span: int, seed: int = 1) -> list[int]:
    """The consumer's sums of `data` received in pieces of random sizes."""
    buffer = memoryview(bytearray(len(data)))
    rng = random.Random(seed)
    with SpanSums(buffer, span) as sums:
        got = 0
        while got < len(data):
            n = min(len(data) - got, rng.randrange(1, 3 * span))
            buffer[got:got + n] = data[got:got + n]
            got += n
            sums.arrived(got)
    return sums.crcs


def test_sums_computed_while_bytes_arrive_equal_the_producers() -> None:
    data = _random_bytes(10 * SPAN + 123)
    sent = span_crcs(data, SPAN)
    assert len(sent) == 11
    assert _sums_as_arriving(data, SPAN) == sent
    assert first_mismatch(_sums_as_arriving(data, SPAN), sent, SPAN, len(data)) is None
    assert span_crcs(b"", SPAN) == [] and _sums_as_arriving(b"", SPAN) == []


def test_a_flipped_bit_is_caught_and_named_by_its_span() -> None:
    data = _random_bytes(10 * SPAN + 123)
    sent = span_crcs(data, SPAN)
    for position in (0, 3 * SPAN + 517, len(data) - 1):
        for bit in (0x01, 0x80):
            corrupted = bytearray(data)
            corrupted[position] ^= bit
            problem = first_mismatch(_sums_as_arriving(bytes(corrupted), SPAN), sent, SPAN, len(data))
            span = position // SPAN
            assert problem is not None and f"bytes {span * SPAN}-{min(len(data), (span + 1) * SPAN)} " in problem


def test_swapped_or_missing_spans_are_caught() -> None:
    data = _random_bytes(6 * SPAN)
    sent = span_crcs(data, SPAN)
    swapped = data[SPAN:2 * SPAN] + data[:SPAN] + data[2 * SPAN:]
    assert "bytes 0-1000 " in (first_mismatch(_sums_as_arriving(swapped, SPAN), sent, SPAN, len(data)) or "")
    short = data[:5 * SPAN]
    assert "summed 6 spans" in (first_mismatch(_sums_as_arriving(short, SPAN), sent, SPAN, len(short)) or "")
    assert "summed 0 spans" in (first_mismatch(_sums_as_arriving(data, SPAN), [], SPAN, len(data)) or "")


def test_a_span_of_no_bytes_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="checksum_span_bytes must be positive"):
        SpanSums(memoryview(bytearray(4)), 0)


def test_a_span_holds_whole_blocks() -> None:
    assert blocks_per_span(720 << 10) == 5 and blocks_per_span(64 << 20) == 1 and blocks_per_span(1024) == 4096


def _caches(num_blocks: int = 20, layers: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(2, num_blocks, 4, 2, 8) for _ in range(layers)]


@pytest.mark.parametrize("in_pieces", [True, False])
def test_spans_read_one_by_one_are_the_blocks_wire_bytes(monkeypatch: pytest.MonkeyPatch, in_pieces: bool) -> None:
    monkeypatch.setattr(source_module, "blocks_per_span", lambda block_bytes: 3)
    caches = _caches()
    block_ids = [7, 2, 19, 4, 11, 0, 5]
    whole = bytes(read_blocks(caches, block_ids))
    block_bytes = len(whole) // len(block_ids)
    source = PullSource(lambda ids, out: read_blocks(caches, ids, out), block_ids, block_bytes, in_pieces=in_pieces)
    spans = [bytes(span) for span in source]  # copied: a span lives until the next is read
    assert [len(s) for s in spans] == [3 * block_bytes, 3 * block_bytes, block_bytes]
    assert b"".join(spans) == whole and source.size == len(whole)
    assert source.crcs == span_crcs(whole, source.span_bytes) and source.span_bytes == 3 * block_bytes


def test_a_stopped_source_reads_no_further_span(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(source_module, "blocks_per_span", lambda block_bytes: 1)
    caches = _caches()
    reads: list[list[int]] = []

    def read(ids: list[int], out: memoryview | None) -> memoryview:
        reads.append(ids)
        return read_blocks(caches, ids, out)

    block_bytes = len(read_blocks(caches, [0]))
    source = PullSource(read, [1, 2, 3, 4], block_bytes)
    spans = iter(source)
    next(spans)
    source.stop()
    assert list(spans) == [] and reads == [[1]]


def test_a_read_into_a_staging_buffer_equals_a_fresh_read() -> None:
    caches = _caches()
    fresh = bytes(read_blocks(caches, [3, 9]))
    staging = numpy.full(len(fresh) + 100, 0xAB, dtype=numpy.uint8).data
    into = read_blocks(caches, [3, 9], staging)
    assert bytes(into) == fresh and into.obj is staging.obj and bytes(staging[len(fresh):]) == b"\xab" * 100


@pytest.mark.parametrize("writable", [True, False])
def test_pulled_bytes_are_written_the_same_from_a_buffer_or_bytes(writable: bool) -> None:
    source = _caches()
    target = [torch.zeros_like(c) for c in source]
    data = read_blocks(source, [5, 17, 1])
    write_blocks(target, [0, 2, 4], data if writable else bytes(data))
    for s, t in zip(source, target, strict=True):
        assert torch.equal(t[:, [0, 2, 4]], s[:, [5, 17, 1]])
        assert not t[:, [1, 3]].any() and not t[:, 5:].any()
