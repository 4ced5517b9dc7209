"""A shared-memory ring buffer that broadcasts byte messages from one writer to N reader processes.

Layout of the one shared segment (a generated name, created by the owner process):

    [ flags: max_chunks x (1 + n_readers) bytes ][ chunk 0 ][ chunk 1 ] ... [ chunk max_chunks-1 ]

Per chunk, flag byte 0 is "written" and flag byte 1 + r is "read by reader r". A chunk holds a 9-byte
header (kind: u8, length: u64 little-endian) and then the payload.

Invariants:
  * The writer and every reader visit the chunks in the same order (0, 1, ..., wrapping around), so
    messages arrive in the order they were written.
  * The writer reuses a chunk only when it was never written or every reader has set its read flag;
    it clears "written", then the read flags, copies the payload, and only then sets "written".
  * A reader reads chunk i only when "written" is set and its own read flag is clear; it sets its read
    flag only after it has finished reading (so the writer never overwrites a chunk being read).
  * A payload larger than a chunk goes through a per-reader pipe; the chunk then carries only the
    overflow marker, and still takes its turn in the ring so ordering is preserved.

Waiting spins briefly (os.sched_yield), then sleeps with exponential backoff capped at 100 us for the
first 20 ms (a busy engine's next step is that close) and at 2 ms after that, so an idle reader costs
almost no CPU. A waiter calls its `is_alive` callback every `liveness_interval` seconds and raises
`PeerDiedError` when it returns False, so a dead peer never hangs the other side.

The owner (the process that called `create`) unlinks the segment. Readers and an attached writer must
be processes started by the owner (spawn or fork): they then share the owner's resource tracker, which
also unlinks the segment if every process dies without cleaning up.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory

_HEADER = struct.Struct("<BQ")  # kind, payload length
_INLINE, _OVERFLOW = 0, 1
_SPIN_S = 50e-6  # busy-poll (with sched_yield) this long before sleeping
_ACTIVE_S = 0.02  # for this long a waiter expects data soon: sleeps are capped at _ACTIVE_MAX_SLEEP_S
_ACTIVE_MAX_SLEEP_S = 100e-6
_IDLE_MAX_SLEEP_S = 2e-3  # then it is idle: it wakes at most ~500 times a second
_fence_lock = threading.Lock()


class PeerDiedError(RuntimeError):
    """The process on the other side of the queue is gone (its liveness check failed)."""


def memory_fence() -> None:
    """Full memory barrier: a lock acquire/release orders our flag and payload stores and loads."""
    with _fence_lock:
        pass


@dataclass(frozen=True)
class QueueSpec:
    """Everything needed to attach to a queue's segment (picklable, passed to child processes)."""

    shm_name: str
    n_readers: int
    max_chunks: int
    max_chunk_bytes: int

    @property
    def flags_bytes(self) -> int:
        return self.max_chunks * (1 + self.n_readers)

    @property
    def total_bytes(self) -> int:
        return self.flags_bytes + self.max_chunks * self.max_chunk_bytes


@dataclass
class WriterHandle:
    """What a writer in another process needs: the spec and the send ends of the overflow pipes."""

    spec: QueueSpec
    overflow: list[Connection]


@dataclass
class ReaderHandle:
    """What reader `rank` needs: the spec and the receive end of its overflow pipe."""

    spec: QueueSpec
    rank: int
    overflow: Connection


class _Waiter:
    """Spin-then-sleep polling with a periodic liveness check and an optional deadline."""

    __slots__ = ("deadline", "interval", "is_alive", "next_check", "sleep", "start")

    def __init__(self, is_alive: Callable[[], bool] | None, timeout: float | None, interval: float) -> None:
        self.start = time.monotonic()
        self.is_alive = is_alive
        self.deadline = None if timeout is None else self.start + timeout
        self.interval = interval
        self.next_check = self.start + interval
        self.sleep = 0.0

    def pause(self, what: str) -> None:
        now = time.monotonic()
        if now - self.start < _SPIN_S:
            os.sched_yield()
            return
        if self.deadline is not None and now >= self.deadline:
            raise TimeoutError(f"shm queue: timed out waiting to {what}")
        if now >= self.next_check:
            self.next_check = now + self.interval
            if self.is_alive is not None and not self.is_alive():
                raise PeerDiedError(f"shm queue: peer process died while waiting to {what}")
        cap = _ACTIVE_MAX_SLEEP_S if now - self.start < _ACTIVE_S else _IDLE_MAX_SLEEP_S
        self.sleep = min(cap, self.sleep * 2 if self.sleep else 10e-6)
        time.sleep(self.sleep)


class ShmBroadcastQueue:
    """One end of a broadcast ring buffer: the writer, or reader `rank`.

    Build with `create` (the owner; it may be the writer or hand the writer role to a child via
    `writer_handle`), `attach_writer` or `attach_reader`.
    """

    def __init__(
        self,
        spec: QueueSpec,
        shm: SharedMemory,
        *,
        owner: bool,
        reader_rank: int | None,
        overflow: list[Connection],
        liveness_interval: float = 0.05,
    ) -> None:
        self.spec = spec
        self._shm = shm
        buf = shm.buf
        assert buf is not None
        self._buf: memoryview = buf
        self._owner = owner
        self.reader_rank = reader_rank
        self._overflow = overflow
        self._peer_ends: list[Connection] = []
        self._index = 0
        self._stride = 1 + spec.n_readers
        self._liveness_interval = liveness_interval
        self._closed = False

    # ---- construction ----------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        n_readers: int,
        max_chunks: int = 8,
        max_chunk_bytes: int = 1 << 20,
        *,
        owner_is_writer: bool = True,
        liveness_interval: float = 0.05,
    ) -> ShmBroadcastQueue:
        """Create the segment (zeroed) and one overflow pipe per reader.

        With `owner_is_writer` the returned object is the writer; otherwise it is reader 0 (only
        valid with n_readers == 1: the owner reads what a child writes, e.g. a response queue).
        """
        if n_readers < 1 or max_chunks < 1 or max_chunk_bytes <= _HEADER.size:
            raise ValueError("need n_readers >= 1, max_chunks >= 1 and max_chunk_bytes > header size")
        if not owner_is_writer and n_readers != 1:
            raise ValueError("an owner that reads needs n_readers == 1")
        probe = QueueSpec("", n_readers, max_chunks, max_chunk_bytes)
        shm = SharedMemory(create=True, size=probe.total_bytes)
        shm.buf[: probe.flags_bytes] = bytes(probe.flags_bytes)  # type: ignore[index]
        spec = QueueSpec(shm.name, n_readers, max_chunks, max_chunk_bytes)
        pipes = [Pipe(duplex=False) for _ in range(n_readers)]  # (recv, send)
        if owner_is_writer:
            queue = cls(
                spec,
                shm,
                owner=True,
                reader_rank=None,
                overflow=[s for _, s in pipes],
                liveness_interval=liveness_interval,
            )
            queue._peer_ends = [r for r, _ in pipes]
        else:
            queue = cls(
                spec,
                shm,
                owner=True,
                reader_rank=0,
                overflow=[pipes[0][0]],
                liveness_interval=liveness_interval,
            )
            queue._peer_ends = [pipes[0][1]]
        return queue

    def reader_handle(self, rank: int) -> ReaderHandle:
        """The handle to pass to reader `rank`'s process (owner that writes only)."""
        if self.reader_rank is not None or not self._peer_ends:
            raise RuntimeError("reader handles come from the owning writer")
        return ReaderHandle(self.spec, rank, self._peer_ends[rank])

    def writer_handle(self) -> WriterHandle:
        """The handle to pass to the writer's process (owner that reads only)."""
        if self.reader_rank is None or not self._peer_ends:
            raise RuntimeError("a writer handle comes from the owning reader")
        return WriterHandle(self.spec, list(self._peer_ends))

    def release_peer_ends(self) -> None:
        """Close the owner's copies of the peers' pipe ends once the peers are started, so a peer's
        death closes its pipe (the writer then sees BrokenPipeError instead of blocking)."""
        for conn in self._peer_ends:
            conn.close()
        self._peer_ends = []

    @classmethod
    def attach_reader(cls, handle: ReaderHandle, liveness_interval: float = 0.05) -> ShmBroadcastQueue:
        shm = SharedMemory(name=handle.spec.shm_name)
        return cls(
            handle.spec,
            shm,
            owner=False,
            reader_rank=handle.rank,
            overflow=[handle.overflow],
            liveness_interval=liveness_interval,
        )

    @classmethod
    def attach_writer(cls, handle: WriterHandle, liveness_interval: float = 0.05) -> ShmBroadcastQueue:
        shm = SharedMemory(name=handle.spec.shm_name)
        return cls(
            handle.spec,
            shm,
            owner=False,
            reader_rank=None,
            overflow=list(handle.overflow),
            liveness_interval=liveness_interval,
        )

    # ---- data path ---------------------------------------------------------------------------------
    def _chunk_offset(self, index: int) -> int:
        return self.spec.flags_bytes + index * self.spec.max_chunk_bytes

    def enqueue(
        self,
        data: bytes | bytearray | memoryview,
        *,
        is_alive: Callable[[], bool] | None = None,
        timeout: float | None = None,
    ) -> None:
        """Broadcast `data` to every reader. Blocks while the next chunk is still being read."""
        if self.reader_rank is not None:
            raise RuntimeError("enqueue on a reader end")
        buf, flags = self._buf, self._index * self._stride
        n = self.spec.n_readers
        waiter: _Waiter | None = None
        while buf[flags] and sum(buf[flags + 1 : flags + 1 + n]) != n:
            if waiter is None:
                waiter = _Waiter(is_alive, timeout, self._liveness_interval)
            waiter.pause("write")
        buf[flags] = 0  # readers now wait on this chunk while it is rewritten
        memory_fence()
        buf[flags + 1 : flags + 1 + n] = bytes(n)
        offset = self._chunk_offset(self._index)
        size = len(data)
        if _HEADER.size + size <= self.spec.max_chunk_bytes:
            _HEADER.pack_into(buf, offset, _INLINE, size)
            buf[offset + _HEADER.size : offset + _HEADER.size + size] = data
            big = False
        else:
            _HEADER.pack_into(buf, offset, _OVERFLOW, size)
            big = True
        memory_fence()
        buf[flags] = 1
        self._index = (self._index + 1) % self.spec.max_chunks
        if big:
            for conn in self._overflow:
                conn.send_bytes(data)

    def dequeue(
        self,
        *,
        is_alive: Callable[[], bool] | None = None,
        timeout: float | None = None,
        decode: Callable[[memoryview], object] | None = None,
    ) -> object:
        """The next message: bytes, or `decode(view)` computed while the chunk is still held (no copy)."""
        rank = self.reader_rank
        if rank is None:
            raise RuntimeError("dequeue on the writer end")
        buf, flags = self._buf, self._index * self._stride
        waiter: _Waiter | None = None
        while not buf[flags] or buf[flags + 1 + rank]:
            if waiter is None:
                waiter = _Waiter(is_alive, timeout, self._liveness_interval)
            waiter.pause("read")
        memory_fence()
        offset = self._chunk_offset(self._index)
        kind, size = _HEADER.unpack_from(buf, offset)
        result: object
        if kind == _INLINE:
            view = buf[offset + _HEADER.size : offset + _HEADER.size + size]
            try:
                result = decode(view) if decode is not None else bytes(view)
            finally:
                view.release()
        else:
            result = None
        memory_fence()
        buf[flags + 1 + rank] = 1
        self._index = (self._index + 1) % self.spec.max_chunks
        if kind == _OVERFLOW:
            data = self._recv_overflow(size, is_alive)
            result = decode(memoryview(data)) if decode is not None else data
        return result

    def _recv_overflow(self, size: int, is_alive: Callable[[], bool] | None) -> bytes:
        conn = self._overflow[0]
        while not conn.poll(self._liveness_interval):
            if is_alive is not None and not is_alive():
                raise PeerDiedError("shm queue: writer died before sending an overflow payload")
        try:
            data = conn.recv_bytes()
        except EOFError as e:
            raise PeerDiedError("shm queue: the overflow pipe closed (writer died)") from e
        if len(data) != size:
            raise RuntimeError(f"shm queue: overflow payload of {len(data)} bytes, header said {size}")
        return data

    # ---- teardown ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Detach from the segment and close pipes; the owner also unlinks the segment. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._buf = None  # type: ignore[assignment]
        for conn in (*self._overflow, *self._peer_ends):
            conn.close()
        with contextlib.suppress(BufferError):  # a caller still holds a view; unmapped at process exit
            self._shm.close()
        if self._owner:
            with contextlib.suppress(FileNotFoundError):
                self._shm.unlink()

    def __enter__(self) -> ShmBroadcastQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
