"""The shared-memory broadcast ring buffer: ordering, fan-out, wrap-around, overflow, dead peers, cleanup."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine_svc.executor.shm_queue import PeerDiedError, ShmBroadcastQueue

pytestmark = pytest.mark.timeout(60)
CTX = mp.get_context("spawn")
REPO = Path(__file__).resolve().parents[2]


def message(i: int) -> bytes:
    """Deterministic payloads of varied sizes; every 7th is larger than a 256-byte chunk."""
    size = 300 + i * 11 if i % 7 == 3 else (i * 37) % 200
    return hashlib.sha256(str(i).encode()).digest() * (size // 32) + bytes([i % 256]) * (size % 32)


def read_all(handle, count: int, result) -> None:
    queue = ShmBroadcastQueue.attach_reader(handle)
    digest = hashlib.sha256()
    for _ in range(count):
        digest.update(queue.dequeue(timeout=30))
        digest.update(b"|")
    queue.close()
    result.send(digest.hexdigest())


def read_one_then_stall(handle, ready) -> None:
    queue = ShmBroadcastQueue.attach_reader(handle)
    queue.dequeue(timeout=30)
    ready.send(True)
    time.sleep(60)


def expected_digest(count: int) -> str:
    digest = hashlib.sha256()
    for i in range(count):
        digest.update(message(i))
        digest.update(b"|")
    return digest.hexdigest()


def shm_segments() -> set[str]:
    return set(os.listdir("/dev/shm"))


@pytest.mark.parametrize("n_readers", [1, 3])
def test_every_reader_gets_every_message_in_order(n_readers: int) -> None:
    # 4 slots and 60 messages: the ring wraps 15 times; messages > 256 bytes take the overflow pipe.
    count = 60
    before = shm_segments()
    with ShmBroadcastQueue.create(n_readers, max_chunks=4, max_chunk_bytes=256) as queue:
        pipes = [CTX.Pipe(duplex=False) for _ in range(n_readers)]
        procs = [
            CTX.Process(target=read_all, args=(queue.reader_handle(r), count, pipes[r][1]))
            for r in range(n_readers)
        ]
        for p in procs:
            p.start()
        queue.release_peer_ends()
        alive = lambda: all(p.is_alive() for p in procs)  # noqa: E731
        for i in range(count):
            queue.enqueue(message(i), is_alive=alive, timeout=30)
        digests = [recv.recv() for recv, _ in pipes]
        for p in procs:
            p.join(10)
            assert p.exitcode == 0
    assert digests == [expected_digest(count)] * n_readers
    assert shm_segments() - before == set()


def test_in_process_round_trip_and_decode_without_copy() -> None:
    with ShmBroadcastQueue.create(1, max_chunks=2, max_chunk_bytes=64) as writer:
        reader = ShmBroadcastQueue.attach_reader(writer.reader_handle(0))
        for i in range(5):  # wraps the 2-slot ring
            writer.enqueue(bytes([i]) * 10)
            assert reader.dequeue(decode=lambda v: (type(v), bytes(v))) == (memoryview, bytes([i]) * 10)
        writer.enqueue(b"")
        assert reader.dequeue() == b""
        reader.close()


def test_writer_blocks_when_ring_full_and_times_out() -> None:
    with ShmBroadcastQueue.create(1, max_chunks=2, max_chunk_bytes=64) as writer:
        reader = ShmBroadcastQueue.attach_reader(writer.reader_handle(0))
        writer.enqueue(b"a")
        writer.enqueue(b"b")
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            writer.enqueue(b"c", timeout=0.2)  # nobody read "a" yet
        assert 0.2 <= time.monotonic() - start < 2
        assert reader.dequeue() == b"a"
        writer.enqueue(b"c", timeout=1)  # slot 0 is free again
        assert [reader.dequeue(), reader.dequeue()] == [b"b", b"c"]
        with pytest.raises(TimeoutError):
            reader.dequeue(timeout=0.1)
        reader.close()


def test_dead_reader_makes_writer_raise_not_hang() -> None:
    before = shm_segments()
    queue = ShmBroadcastQueue.create(2, max_chunks=2, max_chunk_bytes=128)
    ready_recv, ready_send = CTX.Pipe(duplex=False)
    stalled = CTX.Process(target=read_one_then_stall, args=(queue.reader_handle(0), ready_send))
    stalled.start()
    queue.release_peer_ends()
    queue.enqueue(b"first")
    assert ready_recv.poll(30) and ready_recv.recv()
    stalled.kill()
    stalled.join()
    start = time.monotonic()
    with pytest.raises(PeerDiedError):
        for i in range(5):  # reader 1 never reads: the ring fills, then the liveness check fires
            queue.enqueue(bytes([i]), is_alive=stalled.is_alive)
    assert time.monotonic() - start < 2
    queue.close()
    assert shm_segments() - before == set()


def test_dead_writer_makes_reader_raise() -> None:
    with ShmBroadcastQueue.create(1) as writer:
        reader = ShmBroadcastQueue.attach_reader(writer.reader_handle(0))
        start = time.monotonic()
        with pytest.raises(PeerDiedError):
            reader.dequeue(is_alive=lambda: time.monotonic() - start < 0.2)
        assert time.monotonic() - start < 2
        reader.close()


def test_owner_as_reader_of_a_child_writer() -> None:
    """The response-queue shape: the owner reads, a child process writes (including an overflow)."""
    with ShmBroadcastQueue.create(1, max_chunks=2, max_chunk_bytes=64, owner_is_writer=False) as reader:
        proc = CTX.Process(target=write_messages, args=(reader.writer_handle(), 6))
        proc.start()
        reader.release_peer_ends()
        got = [reader.dequeue(is_alive=proc.is_alive, timeout=30) for _ in range(6)]
        proc.join(10)
    assert got == [bytes([i]) * (i * 20) for i in range(6)]


def write_messages(handle, count: int) -> None:
    queue = ShmBroadcastQueue.attach_writer(handle)
    for i in range(count):
        queue.enqueue(bytes([i]) * (i * 20), timeout=30)  # 80 and 100 bytes overflow a 64-byte chunk
    queue.close()


def test_random_sizes_in_process_match() -> None:
    rng = random.Random(7)
    with ShmBroadcastQueue.create(1, max_chunks=3, max_chunk_bytes=100) as writer:
        reader = ShmBroadcastQueue.attach_reader(writer.reader_handle(0))
        for _ in range(200):
            batch = [rng.randbytes(rng.randint(0, 90)) for _ in range(rng.randint(1, 3))]
            for m in batch:
                writer.enqueue(m)
            assert [reader.dequeue() for _ in batch] == batch
        reader.close()


def test_no_leaks_or_resource_tracker_warnings_even_when_a_reader_is_killed() -> None:
    script = textwrap.dedent("""
        import multiprocessing as mp, os, sys
        from engine_svc.executor.shm_queue import ShmBroadcastQueue
        from tests.engine.test_shm_queue import read_all, read_one_then_stall
        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            q = ShmBroadcastQueue.create(2, max_chunks=2, max_chunk_bytes=64)
            r, s = ctx.Pipe(duplex=False)
            ready_r, ready_s = ctx.Pipe(duplex=False)
            a = ctx.Process(target=read_all, args=(q.reader_handle(0), 1, s))
            b = ctx.Process(target=read_one_then_stall, args=(q.reader_handle(1), ready_s))
            a.start(); b.start(); q.release_peer_ends()
            q.enqueue(b"x")
            r.recv(); ready_r.recv()
            b.kill(); a.join(); b.join()
            print(q.spec.shm_name)
            q.close()
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    name = proc.stdout.strip()
    assert name and not os.path.exists(f"/dev/shm/{name}")
    assert "resource_tracker" not in proc.stderr and "leaked" not in proc.stderr, proc.stderr
