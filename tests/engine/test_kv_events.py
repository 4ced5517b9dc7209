"""KV-cache events: what the block pool records (engine_svc/kv/events.py) and how the publisher numbers,
mirrors, snapshots and fans them out (engine_svc/api/kv_events.py). No model and no gRPC here: the pool is
driven by the real scheduler with a fake model, the publisher on a plain asyncio loop.

Checked: replaying the records gives exactly the pool's cache map (through evictions, aborts and
preemptions), every stored record carries its true parent and tokens; batches are numbered with no gap;
a subscription starts with a snapshot of the mirror and continues with every later batch; a subscriber
that falls behind its buffer is dropped (counted) while the others miss nothing and `publish` never waits;
the frontend's index (frontend_svc/engines/kv_index.py) rebuilt from the stream equals the engine's cache.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest
from tandem.engine.v1 import engine_core_pb2 as epb

from engine_svc.api import kv_events as kv_publisher
from engine_svc.api.kv_events import KvEventPublisher, SubscriberDropped, apply_to_mirror, events_to_pb
from engine_svc.kv.events import KVEventLog, StoredBlock
from engine_svc.request import Request
from engine_svc.sched.output import ModelRunnerOutput
from engine_svc.sched.scheduler import Scheduler
from frontend_svc.engines.kv_index import KvBlockIndex, KvEventGap
from shared_runtime.contract import EngineCoreRequest, EngineSamplingParams, SchedulerStats
from shared_runtime.kv_hash import hash_block_tokens, iter_block_hashes

BS = 4


def run_random_workload(sched: Scheduler, log: KVEventLog, seed: int, steps: int = 120) -> list[Any]:
    """Requests sharing prefixes, some aborted, in a cache too small for them all (evictions and
    preemptions happen); returns every record, checking the replay against the pool after each step."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 200) for _ in range(rng.choice((4, 8, 12)))] for _ in range(3)]
    mirror: dict[bytes, Any] = {}
    records: list[Any] = []
    for step_no in range(steps):
        if rng.random() < 0.5:
            prompt = rng.choice(prefixes) + [rng.randrange(3, 200) for _ in range(rng.randrange(1, 9))]
            request = EngineCoreRequest(request_id=f"r{step_no}", prompt_token_ids=prompt,
                                        sampling_params=EngineSamplingParams(max_tokens=rng.randrange(1, 12)))
            sched.add_request(Request(request, sched.max_model_len))
        if sched.requests and rng.random() < 0.1:
            sched.finish_requests([rng.choice(list(sched.requests))])
        so = sched.schedule()
        sampled = [rng.randrange(3, 200) for _ in so.num_scheduled_tokens]
        sched.update_from_output(so, ModelRunnerOutput(req_ids=list(so.num_scheduled_tokens),
                                                       sampled_token_ids=sampled))
        taken = log.take()
        records.extend(taken)
        apply_to_mirror(mirror, taken)
        cached = sched.kv.pool.cached
        assert mirror.keys() == cached.keys(), f"step {step_no}: the replayed records disagree with the pool"
        assert all(mirror[h][1] == block.token_ids for h, block in cached.items())
    return records


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_replaying_the_records_gives_the_pools_cache_exactly(seed: int) -> None:
    log = KVEventLog()
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=BS, num_blocks=12,
                      kv_events=log)
    records = run_random_workload(sched, log, seed)
    removed = [r for r in records if not isinstance(r, StoredBlock)]
    assert removed and sched.num_preemptions, "the workload must evict and preempt to test anything"
    for record in records:
        if isinstance(record, StoredBlock):  # the hash is the engine's function of exactly this parent and tokens
            assert record.block_hash == hash_block_tokens(record.parent_hash, record.token_ids)
            assert len(record.token_ids) == BS


def test_a_prompts_hashes_on_the_frontend_equal_the_engines() -> None:
    rng = random.Random(5)
    prompt = [rng.randrange(0, 50_000) for _ in range(67)]
    request = Request(EngineCoreRequest(request_id="x", prompt_token_ids=prompt,
                                        sampling_params=EngineSamplingParams()), 1024)
    log = KVEventLog()
    sched = Scheduler(max_num_seqs=1, max_num_batched_tokens=128, max_model_len=128, block_size=16,
                      num_blocks=8, kv_events=log)
    sched.add_request(request)
    sched.schedule()
    engine_side = [r.block_hash for r in log.take() if isinstance(r, StoredBlock)]
    assert engine_side == request.block_hashes == list(iter_block_hashes(prompt, 16))
    assert len(engine_side) == 4


def test_stored_records_group_into_chains_and_removals_into_runs() -> None:
    h = [hash_block_tokens(None, [i] * BS) for i in range(3)]
    c1 = hash_block_tokens(h[0], [9] * BS)
    c2 = hash_block_tokens(c1, [8] * BS)
    records = [StoredBlock(h[0], None, (0,) * BS), StoredBlock(c1, h[0], (9,) * BS), StoredBlock(c2, c1, (8,) * BS),
               StoredBlock(h[1], None, (1,) * BS), h[2], c2, StoredBlock(h[2], None, (2,) * BS)]
    events = events_to_pb(records, BS)
    assert [e.WhichOneof("kind") for e in events] == ["stored", "stored", "removed", "stored"]
    first = events[0].stored
    assert [b.block_hash for b in first.blocks] == [h[0], c1, c2] and first.parent_block_hash == b""
    assert list(first.blocks[1].token_ids) == [9] * BS and first.block_size == BS
    assert list(events[2].removed.block_hashes) == [h[2], c2]
    # A chain continuing a block cached in an earlier batch names that block as its parent.
    [later] = events_to_pb([StoredBlock(c2, c1, (8,) * BS)], BS)
    assert later.stored.parent_block_hash == c1


# ---- the publisher ------------------------------------------------------------------------------------------
def stored(*tokens: int, parent: bytes | None = None) -> StoredBlock:
    return StoredBlock(hash_block_tokens(parent, tokens), parent, tokens)


async def take(stream: AsyncIterator[epb.KvEventBatch], count: int) -> list[epb.KvEventBatch]:
    """The next `count` messages; fails after 5 s without one (a batch that never comes)."""
    return [await asyncio.wait_for(anext(stream), 5) for _ in range(count)]


def test_batches_are_numbered_and_a_subscription_starts_with_a_snapshot() -> None:
    async def scenario() -> None:
        publisher = KvEventPublisher("engine-1", BS)
        early = publisher.subscribe().batches()
        [snapshot] = await take(early, 1)
        assert snapshot.sequence_number == 0 and snapshot.snapshot.count == 1
        assert [e.WhichOneof("kind") for e in snapshot.events] == ["cleared"]

        a = stored(1, 2, 3, 4)
        b = stored(5, 6, 7, 8, parent=a.block_hash)
        publisher.publish([a, b], SchedulerStats(num_running=3))
        late = publisher.subscribe().batches()
        publisher.publish([a.block_hash], None)
        [one, two] = await take(early, 2)
        assert (one.sequence_number, two.sequence_number) == (1, 2)
        assert one.scheduler_stats.num_running == 3 and not two.HasField("scheduler_stats")
        assert one.engine_id == "engine-1" and not one.HasField("snapshot")
        [snap, live] = await take(late, 2)
        assert snap.sequence_number == 1 and snap.snapshot.num_blocks == 2
        assert [blk.block_hash for blk in snap.events[1].stored.blocks] == [a.block_hash, b.block_hash]
        assert live.sequence_number == 2
        assert publisher.mirror == {b.block_hash: (a.block_hash, b.token_ids)}
        assert publisher.counters.sent_events == 1 + 2 + 1 + (1 + 2) + 1  # snapshots' clears included

    asyncio.run(scenario())


def test_a_large_snapshot_comes_in_chunks_that_rebuild_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_publisher, "SNAPSHOT_CHUNK_BLOCKS", 3)

    async def scenario() -> None:
        publisher = KvEventPublisher("e", BS)
        blocks = [stored(i, i, i, i) for i in range(7)]
        publisher.publish(blocks, None)
        publisher.publish([blocks[2].block_hash], None)
        stream = publisher.subscribe().batches()
        chunks = await take(stream, 2)
        assert [(c.snapshot.index, c.snapshot.count, c.sequence_number) for c in chunks] == [(0, 2, 2), (1, 2, 2)]
        index = KvBlockIndex()
        index.apply(chunks[0])
        assert len(index) == 0, "a partial snapshot must not replace the view"
        index.apply(chunks[1])
        assert index.blocks == set(publisher.mirror) and len(index) == 6
        publisher.publish([stored(9, 9, 9, 9), blocks[0].block_hash], None)
        [live] = await take(stream, 1)
        index.apply(live)
        assert index.blocks == set(publisher.mirror) and len(index) == 6 and index.sequence == 3

    asyncio.run(scenario())


def test_subscriptions_share_one_snapshot_until_the_next_batch_and_are_capped() -> None:
    """Before: each subscription copied the whole mirror (+0.68 MB per unread subscriber at 8k blocks) and
    converted its own chunks, with no bound on subscribers. Now subscriptions made before the next batch
    share one snapshot, each chunk converted once, and past `max_subscribers` subscribe() refuses."""
    import tracemalloc

    async def scenario() -> None:
        publisher = KvEventPublisher("e", BS, max_subscribers=40)
        publisher.publish([stored(i, i + 1, i + 2, i + 3) for i in range(4000)], None)
        first = publisher.subscribe()
        tracemalloc.start()
        rest = [publisher.subscribe() for _ in range(38)]
        grown, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert grown < 200_000, f"38 subscriptions took {grown} bytes (a copy of 4,000 entries is ~450 kB)"
        assert all(s._snapshot is first._snapshot for s in rest)
        streams = [first.batches(), rest[0].batches()]  # (kept: a finished stream closes its subscription)
        chunks = [await take(stream, 1) for stream in streams]
        assert chunks[0][0] is chunks[1][0]  # converted once
        publisher.publish([stored(1, 1, 1, 1)], None)
        later = publisher.subscribe()  # the 40th
        assert later._snapshot is not first._snapshot and later._snapshot.sequence == 2  # type: ignore[union-attr]
        with pytest.raises(kv_publisher.TooManySubscribers):
            publisher.subscribe()
        later.close()
        publisher.subscribe()  # a place came back

    asyncio.run(scenario())


def test_a_slow_subscriber_is_dropped_and_the_others_miss_nothing() -> None:
    async def scenario() -> None:
        publisher = KvEventPublisher("e", BS, buffer=2)
        slow = publisher.subscribe().batches()  # never read until the end
        fast = publisher.subscribe().batches()
        received: list[int] = []

        async def read_fast() -> None:
            async for batch in fast:
                received.append(batch.sequence_number)

        reader = asyncio.create_task(read_fast())
        for i in range(6):
            publisher.publish([stored(i, i, i, i)], None)  # plain call: it never waits for anyone
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        assert publisher.counters.dropped_subscribers == 1 and publisher.num_subscribers == 1
        assert publisher.counters.dropped_events == 3  # its two buffered batches and the one that overflowed
        with pytest.raises(SubscriberDropped):
            await anext(slow)
        assert received == [0, 1, 2, 3, 4, 5, 6]  # the snapshot, then every batch
        reader.cancel()

    asyncio.run(scenario())


def test_the_frontend_index_refuses_gaps_and_other_engine_processes() -> None:
    index = KvBlockIndex()
    with pytest.raises(KvEventGap):
        index.apply(epb.KvEventBatch(sequence_number=1, engine_id="e"))  # live before any snapshot
    snapshot = epb.KvEventBatch(sequence_number=4, engine_id="e", snapshot=epb.KvSnapshotChunk(index=0, count=1),
                                events=events_to_pb([stored(1, 1, 1, 1)], BS))
    index.apply(snapshot)
    assert len(index) == 1 and index.sequence == 4
    with pytest.raises(KvEventGap):
        index.apply(epb.KvEventBatch(sequence_number=6, engine_id="e"))
    assert len(index) == 0 and index.sequence is None, "a gap empties the index"
    index.apply(snapshot)
    with pytest.raises(KvEventGap):
        index.apply(epb.KvEventBatch(sequence_number=5, engine_id="restarted"))
    assert len(index) == 0
