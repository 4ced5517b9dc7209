"""A pull's integrity check: the zlib CRC-32 of each span of its bytes.

A pull's bytes are cut into spans of `span_bytes` (a whole number of blocks; the last span may be
shorter). The producer computes each span's CRC-32 as it reads the span from the cache and sends the list
on the stream's last chunk; the consumer computes the same over what arrived, span by span while the
rest is still arriving, and refuses the pull on any difference. CRC-32 catches every error burst of up
to 32 bits in a span, and any other change to it (bytes flipped, lost, reordered, or another pull's
bytes) but with probability 2^-32; it guards against corruption, not against a hostile producer (the
engine token or TLS authenticate the peer). `zlib.crc32` releases the GIL on large buffers, so the
consumer's sums run on a thread of their own beside the receive.
"""

from __future__ import annotations

import queue
import threading
import zlib
from types import TracebackType

SPAN_TARGET_BYTES = 4 << 20  # a span holds as many whole blocks as fit in this (at least one)


def blocks_per_span(block_bytes: int) -> int:
    """Blocks in one checksum span for blocks of `block_bytes`: at least one."""
    return max(1, SPAN_TARGET_BYTES // max(block_bytes, 1))


def span_crcs(data: bytes | bytearray | memoryview, span_bytes: int) -> list[int]:
    """The CRC-32 of each span of `data` (one per started span; none for no bytes)."""
    view = memoryview(data).cast("B")
    return [zlib.crc32(view[start:start + span_bytes]) for start in range(0, len(view), span_bytes)]


def first_mismatch(got: list[int], sent: list[int], span_bytes: int, size: int) -> str | None:
    """A message naming the first span whose sum differs (or the counts when they do); None: they agree."""
    if len(got) != len(sent):
        return (f"checksum mismatch: the producer summed {len(sent)} spans of {span_bytes} bytes, "
                f"the {size} bytes received make {len(got)}")
    for index, (mine, theirs) in enumerate(zip(got, sent, strict=True)):
        if mine != theirs:
            end = min(size, (index + 1) * span_bytes)
            return (f"checksum mismatch: bytes {index * span_bytes}-{end} of the pull arrived corrupted "
                    f"(CRC-32 {mine:08x}, the producer's {theirs:08x})")
    return None


class SpanSums:
    """The consumer's CRC-32 of each span of `buffer` while its bytes arrive in order, on a thread of its own.

    `arrived(end)` says bytes [0, end) are in (ends never decrease); every span wholly in is summed as
    soon as it is. Leaving the `with` block sums the last, partial span (up to the last `end` given) and
    waits for the thread; `crcs` is then complete. Used from one thread (the receiving one)."""

    def __init__(self, buffer: memoryview, span_bytes: int) -> None:
        if span_bytes <= 0:
            raise ValueError(f"checksum_span_bytes must be positive, got {span_bytes}")
        self.buffer = buffer
        self.span_bytes = span_bytes
        self.crcs: list[int] = []
        self._summed = 0  # bytes handed to the thread
        self._end = 0
        self._spans: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-pull-crc")

    def __enter__(self) -> SpanSums:
        self._thread.start()
        return self

    def arrived(self, end: int) -> None:
        self._end = end
        while end - self._summed >= self.span_bytes:
            self._spans.put((self._summed, self._summed + self.span_bytes))
            self._summed += self.span_bytes

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if kind is None and self._end > self._summed:
            self._spans.put((self._summed, self._end))
            self._summed = self._end
        self._spans.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (span := self._spans.get()) is not None:
            self.crcs.append(zlib.crc32(self.buffer[span[0]:span[1]]))
