"""The engine's scale-out RPCs over real gRPC: SubscribeKvEvents and GetTokenizer.

- On a real (tiny) engine in process, with a KV cache small enough to evict: a subscriber that follows the
  stream from the start, one that reconnects mid-run and one that connects at the end all hold exactly the
  engine's cache map (read from the core once the engine is idle); a subscriber that never reads does not
  stop the engine; GetEngineInfo announces events and the tokenizer checksum.
- Without a model (the servicer and a publisher fed directly, so batches can be large): a subscriber that
  stops reading is dropped with RESOURCE_EXHAUSTED once its buffer is full while another one receives every
  batch; events off answer FAILED_PRECONDITION.
- GetTokenizer streams the model's tokenizer files in chunks whose concatenation matches the announced
  SHA-256; the archive depends only on the files (the same files elsewhere give the same checksum, a
  changed chat template another); a model without tokenizer.json answers NOT_FOUND.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from tandem.engine.v1 import engine_core_pb2 as epb
from tandem.engine.v1 import engine_core_pb2_grpc as epb_grpc

from engine_svc.api.engine_core import EngineCoreServicer
from engine_svc.api.kv_events import KvEventPublisher
from engine_svc.api.server import EngineServer
from engine_svc.api.tokenizer_archive import read_tokenizer_archive
from engine_svc.config import EngineConfig
from engine_svc.kv.events import StoredBlock
from frontend_svc.engines.kv_index import KvBlockIndex
from shared_runtime import tokenizer_bundle
from shared_runtime.kv_hash import hash_block_tokens
from tests.engine.test_engine_server import ServerThread
from tests.engine_stream import EngineStream, engine_idle
from tests.support import LoopThread, wait_until

BLOCK_SIZE, NUM_BLOCKS = 4, 32


class Follower:
    """A subscriber in a thread: applies every batch to a frontend `KvBlockIndex`."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.index = KvBlockIndex()
        self.call = epb_grpc.EngineCoreServiceStub(channel).SubscribeKvEvents(epb.SubscribeKvEventsRequest())
        self.error: grpc.RpcError | None = None
        self.snapshot_done = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for batch in self.call:
                self.index.apply(batch)
                if batch.HasField("snapshot") and batch.snapshot.index + 1 == batch.snapshot.count:
                    self.snapshot_done.set()
        except grpc.RpcError as error:
            self.error = error


@pytest.fixture(scope="module")
def engine(llama_dir: Path) -> Iterator[ServerThread]:
    config = EngineConfig.create(model=str(llama_dir), dtype="float32", device="cpu", max_num_seqs=4,
                                 block_size=BLOCK_SIZE, num_gpu_blocks_override=NUM_BLOCKS)
    running = ServerThread(EngineServer(config, host="127.0.0.1", port=0)).start()
    wait_until(lambda: engine_idle(running.address), 60, "engine up", retry_on=(grpc.RpcError,))
    yield running
    running.begin_drain()
    assert running.join(15) == 0


def engine_cache(engine: ServerThread) -> set[bytes]:
    core = engine.server.servicer.core  # type: ignore[union-attr]
    return set(core.scheduler.kv.pool.cached)


def run_conversations(channel: grpc.Channel, first: int, count: int) -> None:
    """`count` requests over three shared prefixes: more blocks than the cache holds, so it evicts."""
    stream = EngineStream(channel)
    ids = [f"req-{i}" for i in range(first, first + count)]
    for i, rid in enumerate(ids):
        prefix = [(first + i) % 3 * 50 + t + 3 for t in range(12)]
        stream.add(rid, prefix + [(i * 7 + t) % 400 + 3 for t in range(6)], max_tokens=6)
    stream.wait_finished(*ids, timeout=60)
    stream.close()


def test_subscribers_hold_the_engines_exact_cache_whenever_they_connect(engine: ServerThread) -> None:
    with engine.channel() as channel:
        info = epb_grpc.EngineCoreServiceStub(channel).GetEngineInfo(epb.GetEngineInfoRequest(), timeout=10)
        assert info.kv_cache_events and len(info.tokenizer_sha256) == 64
        stalled = epb_grpc.EngineCoreServiceStub(channel).SubscribeKvEvents(epb.SubscribeKvEventsRequest())
        from_start = Follower(channel)
        assert from_start.snapshot_done.wait(10)
        run_conversations(channel, 0, 12)
        reconnecting = Follower(channel)  # a subscriber that (re)connects mid-run gets a snapshot first
        run_conversations(channel, 12, 12)
        wait_until(lambda: engine_idle(engine.address), 30, "engine idle")
        cache = engine_cache(engine)
        assert len(cache) > 0
        at_end = Follower(channel)
        for follower in (from_start, reconnecting, at_end):
            wait_until(lambda f=follower: f.index.blocks == cache, 10, "the subscriber's view equals the cache")
            assert follower.error is None
        assert from_start.index.sequence == at_end.index.sequence  # live batches and snapshot agree
        stalled.cancel()  # it never read a message, and the engine ran 24 requests meanwhile


def test_a_snapshot_lists_each_block_with_its_true_parent_and_tokens(engine: ServerThread) -> None:
    with engine.channel() as channel:
        run_conversations(channel, 100, 6)
        wait_until(lambda: engine_idle(engine.address), 30, "engine idle")
        call = epb_grpc.EngineCoreServiceStub(channel).SubscribeKvEvents(epb.SubscribeKvEventsRequest())
        first = next(call)
        call.cancel()
    pool = engine.server.servicer.core.scheduler.kv.pool  # type: ignore[union-attr]
    blocks = [(s.parent_block_hash, s.blocks) for e in first.events[1:] for s in [e.stored]]
    seen = 0
    for parent, chain in blocks:
        for block in chain:
            assert tuple(block.token_ids) == pool.cached[block.block_hash].token_ids
            assert block.block_hash == hash_block_tokens(parent or None, list(block.token_ids))
            parent = block.block_hash
            seen += 1
    assert seen == len(pool.cached) == first.snapshot.num_blocks


# ---- without a model --------------------------------------------------------------------------------------
@pytest.fixture()
def bare(loop: LoopThread) -> Iterator[Any]:
    """A gRPC server with only the servicer: a publisher (buffer 16) fed by the test, no engine."""
    config = SimpleNamespace(model_name="m", block_size=BLOCK_SIZE)

    async def start() -> Any:
        servicer = EngineCoreServicer(config, asyncio.get_running_loop())  # type: ignore[arg-type]
        servicer.kv_events = KvEventPublisher("bare", BLOCK_SIZE, buffer=16)
        server = grpc.aio.server()
        epb_grpc.add_EngineCoreServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return SimpleNamespace(servicer=servicer, server=server, address=f"127.0.0.1:{port}")

    running = loop.run(start())
    yield running
    loop.run(running.server.stop(None))


def big_batch(n: int, blocks: int = 2000) -> list[Any]:
    """Batch n: 2000 new blocks (~180 kB on the wire), and the previous batch's blocks removed."""
    def block(i: int, k: int) -> StoredBlock:
        tokens = (i, k, 0, 0)
        return StoredBlock(hash_block_tokens(None, tokens), None, tokens)

    previous = [block(n - 1, k).block_hash for k in range(blocks)] if n > 1 else []
    return [*previous, *(block(n, k) for k in range(blocks))]


def test_a_subscriber_that_stops_reading_is_dropped_and_the_other_gets_everything(
        bare: Any, loop: LoopThread) -> None:
    publisher = bare.servicer.kv_events
    with grpc.insecure_channel(bare.address) as channel:
        stub = epb_grpc.EngineCoreServiceStub(channel)
        slow = stub.SubscribeKvEvents(epb.SubscribeKvEventsRequest(), timeout=120)
        assert next(slow).HasField("snapshot")  # subscribed; it reads nothing more for now
        fast = Follower(channel)
        assert fast.snapshot_done.wait(10)
        number = 0
        while publisher.counters.dropped_subscribers == 0:
            number += 1
            assert number < 2000, "the stalled subscriber was never dropped"
            loop.call(lambda n=number: publisher.publish(big_batch(n), None))
            wait_until(lambda n=number: (fast.index.sequence or 0) >= n - 8, 30, "the fast subscriber keeps up")
        assert publisher.num_subscribers == 1 and publisher.counters.dropped_events >= 16 * 4000
        sequences = []
        with pytest.raises(grpc.RpcError) as info:
            for batch in slow:  # it reads again: what it was sent, then the verdict
                sequences.append(batch.sequence_number)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "subscribe again" in info.value.details()
        assert sequences == list(range(1, len(sequences) + 1)) and len(sequences) < number
        wait_until(lambda: fast.index.sequence == number, 30, "the fast subscriber got every batch")
        assert fast.error is None and len(fast.index) == 2000


def test_events_off_is_failed_precondition(bare: Any) -> None:
    bare.servicer.kv_events = None
    with grpc.insecure_channel(bare.address) as channel:
        call = epb_grpc.EngineCoreServiceStub(channel).SubscribeKvEvents(epb.SubscribeKvEventsRequest(), timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            next(call)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


# ---- GetTokenizer -------------------------------------------------------------------------------------------
def fetch(address: str) -> tuple[bytes, list[epb.TokenizerChunk]]:
    with grpc.insecure_channel(address) as channel:
        chunks = list(epb_grpc.EngineCoreServiceStub(channel).GetTokenizer(epb.GetTokenizerRequest(), timeout=10))
    return b"".join(c.data for c in chunks), chunks


def serve_archive(bare: Any, loop: LoopThread, model: Path) -> None:
    bare.servicer.tokenizer = loop.call(lambda: asyncio.get_running_loop().create_future())
    loop.call(lambda: bare.servicer.tokenizer.set_result(read_tokenizer_archive(model)))


def test_get_tokenizer_streams_the_model_files_with_their_checksum(
        bare: Any, loop: LoopThread, llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokenizer_bundle, "CHUNK_BYTES", 4096)
    serve_archive(bare, loop, llama_dir)
    data, chunks = fetch(bare.address)
    assert len(chunks) > 2 and chunks[0].total_size == len(data) and chunks[0].model_name == "m"
    assert [bool(c.sha256) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    files = tokenizer_bundle.unpack(data, chunks[-1].sha256)
    expected = {p.name: p.read_bytes() for p in llama_dir.iterdir() if p.name in tokenizer_bundle.FILE_NAMES}
    assert files == expected and "tokenizer.json" in files and "model.safetensors" not in files

    copy = tmp_path / "elsewhere"
    shutil.copytree(llama_dir, copy)
    assert read_tokenizer_archive(copy).sha256 == chunks[-1].sha256  # type: ignore[union-attr]
    config = copy / "tokenizer_config.json"
    config.write_text(config.read_text().replace("{{", "{{- ", 1))
    assert read_tokenizer_archive(copy).sha256 != chunks[-1].sha256  # type: ignore[union-attr]

    (copy / "tokenizer.json").unlink()
    serve_archive(bare, loop, copy)
    with pytest.raises(grpc.RpcError) as info:
        fetch(bare.address)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
