"""The producer's bytes of one pull, span by span (the checksum spans of checksum.py).

Iterating a `PullSource` reads each span's blocks from the cache only when the sender asks for it, so the
gather of span i+1 overlaps the consumer's receive of span i, and sums each span (CRC-32) right after
reading it, while its bytes are still in the CPU's cache. Every span is gathered into the same staging
buffer of one span's size (fresh host memory costs a page fault per page, more than the copy itself;
`host_buffer` makes it, pinned for a CUDA cache: blocks.staging_buffer), so
a span is valid only until the next one is asked for: the sender sends or copies it first. When the cache
is split over worker processes (`in_pieces=False`: each read is a command through the workers, in step
order), all blocks are read at once and then cut into spans. Every span holds `blocks_per_span` whole
blocks (the last may hold fewer); after a whole iteration `crcs` holds one sum per span. `stop()` makes
an iteration in progress end before its next span (the pull was withdrawn).

`pieces()` is the side channel's iteration: each span as a list of buffers to send in order. With `views`
(a cache in this process that can be sent as it lies: blocks.cache_views) they are views of the cache's
own memory - no gather, no staging copy; the span's CRC-32 is chained over the same views, so it sums
exactly the bytes sent (the blocks are held under the pull's lease and nothing writes them meanwhile).
Without `views` each span is the staging span alone, as `__iter__` yields it.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Generator, Iterator

from engine_svc.kv_transfer.blocks import BlockViews, staging_buffer
from engine_svc.kv_transfer.checksum import blocks_per_span

# The wire bytes of these blocks, gathered into the given buffer when there is one (the result views it)
ReadBlocks = Callable[[list[int], memoryview | None], bytes | memoryview]
# Host memory of the given size for the staging span (blocks.staging_buffer: pinned for a CUDA cache)
HostBuffer = Callable[[int], memoryview]


class PullSource:
    def __init__(self, read: ReadBlocks, block_ids: list[int], block_bytes: int, *, in_pieces: bool = True,
                 views: BlockViews | None = None, host_buffer: HostBuffer = staging_buffer) -> None:
        self.read = read
        self.host_buffer = host_buffer
        self.views = views
        self.block_ids = block_ids
        self.block_bytes = block_bytes
        self.in_pieces = in_pieces
        self.span_blocks = blocks_per_span(block_bytes)
        self.span_bytes = self.span_blocks * block_bytes
        self.size = len(block_ids) * block_bytes
        self.crcs: list[int] = []
        self._stopped = False

    def stop(self) -> None:
        self._stopped = True

    def __iter__(self) -> Iterator[memoryview]:
        if not self.in_pieces:
            yield from self._cut(self._read(self.block_ids, None) if self.block_ids else memoryview(b""))
            return
        step = self.span_blocks
        staging = self.host_buffer(self.span_bytes if self.block_ids else 0)
        for first in range(0, len(self.block_ids), step):
            if self._stopped:
                return
            span = self._read(self.block_ids[first:first + step], staging)
            self.crcs.append(zlib.crc32(span))
            yield span

    def pieces(self) -> Generator[list[memoryview], None, None]:
        """Each span as the buffers that make it, in wire order (module docstring), summed before it is
        yielded."""
        if self.views is None or not self.in_pieces:
            for span in self:
                yield [span]
            return
        step = self.span_blocks
        for first in range(0, len(self.block_ids), step):
            if self._stopped:
                return
            block_ids = self.block_ids[first:first + step]
            views = self.views(block_ids)
            crc = size = 0
            for view in views:
                crc = zlib.crc32(view, crc)
                size += len(view)
            if size != len(block_ids) * self.block_bytes:
                raise RuntimeError(f"the cache's views hold {size} bytes for {len(block_ids)} blocks of "
                                   f"{self.block_bytes}")
            self.crcs.append(crc)
            yield views

    def _cut(self, whole: memoryview) -> Iterator[memoryview]:
        for start in range(0, len(whole), self.span_bytes):
            if self._stopped:
                return
            span = whole[start:start + self.span_bytes]
            self.crcs.append(zlib.crc32(span))
            yield span

    def _read(self, block_ids: list[int], out: memoryview | None) -> memoryview:
        data = memoryview(self.read(block_ids, out)).cast("B")
        if len(data) != len(block_ids) * self.block_bytes:
            raise RuntimeError(f"read {len(data)} bytes for {len(block_ids)} blocks of {self.block_bytes}")
        return data
