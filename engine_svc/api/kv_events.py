"""KV-cache events off the busy loop: numbered, mirrored, converted and fanned out to subscribers.

The busy loop hands each iteration's records (engine_svc/kv/events.py) to `KvEventPublisher.publish`
through `call_soon_threadsafe`; everything in this module runs on the server's event loop. Each
`SubscribeKvEvents` stream holds one `Subscription` (`stream_kv_events` serves it: a snapshot, then live
batches; RESOURCE_EXHAUSTED when the subscriber fell too far behind or `max_subscribers` streams are
open already, FAILED_PRECONDITION when events are off).

Invariants:
- Published batches are numbered 1, 2, 3, ... in publication order, per engine process.
- `mirror` holds exactly the engine's cached blocks as of the last published batch (hash -> parent hash
  and token ids), in the order they were cached: replaying every record from an empty cache gives it.
  `adapters` holds the LoRA adapter of each of those blocks computed under one (base-model blocks have
  none), so a snapshot reports every block's adapter as the live event that stored it did.
- A subscription yields a snapshot of the mirror taken when it was created (chunks that all carry the
  sequence number S of the last batch it includes; the first chunk starts with a `cleared` event), then
  every batch numbered S+1, S+2, ... in order, none skipped; or, once it is dropped, nothing more.
- A subscription never holds more than `buffer` batches it has not sent; a batch beyond that drops it
  (its stream then ends with RESOURCE_EXHAUSTED and the subscriber must subscribe again). `publish`
  never waits for a subscriber: a slow one cannot slow the engine, only lose its subscription.
- Each batch is converted to protobuf once, whoever subscribes; with no subscriber nothing is converted.
- At most `max_subscribers` subscriptions are open at once (both protocols' together); one more is refused.
- Subscriptions made before the next batch share one `Snapshot` (one copy of the mirror's entries, each
  chunk converted once): an unread subscriber holds no copy of the cache of its own.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from tandem.engine.v1 import engine_core_pb2 as pb

from engine_svc.kv.events import BlockAdapter, KVEvent, StoredBlock
from shared_runtime.contract import SchedulerStats
from shared_runtime.kv_hash import BlockHash
from shared_runtime.to_pb import stats_to_pb

logger = logging.getLogger(__name__)

DEFAULT_BUFFER = 1024  # batches (about one per engine step) a subscriber may fall behind before it is dropped
DEFAULT_MAX_SUBSCRIBERS = 128  # open subscriptions per engine (a deployment's frontends and routers)
SNAPSHOT_CHUNK_BLOCKS = 4096  # blocks per snapshot message (~0.4 MB at block size 16: far below 4 MiB)

Entry = tuple[BlockHash | None, tuple[int, ...]]  # a cached block's parent hash and token ids


class SubscriberDropped(Exception):
    """The subscriber fell more than `buffer` batches behind; it must subscribe again."""


class TooManySubscribers(Exception):
    """`max_subscribers` subscriptions are open already."""


@dataclass
class KvEventCounters:
    """Cumulative, read by the Prometheus collector at scrape time (engine_svc/telemetry/metrics.py)."""

    sent_events: int = 0  # stored/removed/cleared events handed to subscriber streams, snapshots included
    dropped_events: int = 0  # events a dropped subscriber never got (its backlog and the overflowing batch)
    dropped_subscribers: int = 0  # subscriptions ended for reading too slowly


class KvEventPublisher:
    """The engine's prefix cache as a stream of numbered batches, for any number of subscribers."""

    def __init__(self, engine_id: str, block_size: int, buffer: int = DEFAULT_BUFFER,
                 max_subscribers: int = DEFAULT_MAX_SUBSCRIBERS) -> None:
        if buffer < 1:
            raise ValueError(f"the KV event buffer must hold at least one batch, got {buffer}")
        if max_subscribers < 1:
            raise ValueError(f"at least one KV event subscriber must be allowed, got {max_subscribers}")
        self.engine_id = engine_id
        self.block_size = block_size
        self.buffer = buffer
        self.max_subscribers = max_subscribers
        self.sequence = 0  # the number of the last published batch
        self.mirror: dict[BlockHash, Entry] = {}
        self.adapters: dict[BlockHash, BlockAdapter] = {}  # the mirror's blocks computed under a LoRA adapter
        self.counters = KvEventCounters()
        self._subscriptions: set[Subscription] = set()
        self._snapshot: Snapshot | None = None  # the mirror as of `sequence`, once someone subscribed

    @property
    def num_subscribers(self) -> int:
        return len(self._subscriptions)

    def publish(self, events: Sequence[KVEvent], stats: SchedulerStats | None) -> None:
        """One busy-loop iteration's records: mirror them, number them, queue them for every subscriber."""
        self.sequence += 1
        self._snapshot = None
        apply_to_mirror(self.mirror, events, self.adapters)
        if not self._subscriptions:
            return
        batch = pb.KvEventBatch(sequence_number=self.sequence, timestamp=time.time(), engine_id=self.engine_id)
        add_events(batch.events, events, self.block_size)
        if stats is not None:
            batch.scheduler_stats.CopyFrom(stats_to_pb(stats))
        num_events = count_events(batch)
        for subscription in list(self._subscriptions):
            subscription.offer(batch, num_events)

    def subscribe(self) -> Subscription:
        """A new subscription, starting with a snapshot of what is cached now (shared with every other
        subscription made before the next batch). Raises TooManySubscribers at `max_subscribers`."""
        if len(self._subscriptions) >= self.max_subscribers:
            raise TooManySubscribers
        if self._snapshot is None:
            adapters = self.adapters
            self._snapshot = Snapshot(self, tuple((h, e, adapters.get(h)) for h, e in self.mirror.items()),
                                      self.sequence)
        subscription = Subscription(self, self._snapshot)
        self._subscriptions.add(subscription)
        return subscription

    def close(self) -> None:
        """End every subscription (the engine is shutting down)."""
        for subscription in list(self._subscriptions):
            subscription.close()

    def _forget(self, subscription: Subscription) -> None:
        self._subscriptions.discard(subscription)


class Snapshot:
    """The mirror as of batch `sequence`, as the chunks a subscription starts with: at most
    SNAPSHOT_CHUNK_BLOCKS blocks per message, each converted once, when the first subscription sending it
    gets there (a large cache is converted between writes, not all at once on the event loop), and kept
    while any subscription still has the snapshot to send."""

    def __init__(self, publisher: KvEventPublisher,
                 items: tuple[tuple[BlockHash, Entry, BlockAdapter | None], ...], sequence: int) -> None:
        self._publisher = publisher
        self._items = items
        self.sequence = sequence
        self.count = max(1, -(-len(items) // SNAPSHOT_CHUNK_BLOCKS))
        self._chunks: list[tuple[pb.KvEventBatch, int] | None] = [None] * self.count

    def chunk(self, index: int) -> tuple[pb.KvEventBatch, int]:
        """Chunk `index` and the number of events it holds."""
        done = self._chunks[index]
        if done is None:
            publisher, items = self._publisher, self._items
            part = items[index * SNAPSHOT_CHUNK_BLOCKS : (index + 1) * SNAPSHOT_CHUNK_BLOCKS]
            batch = pb.KvEventBatch(
                sequence_number=self.sequence, timestamp=time.time(), engine_id=publisher.engine_id,
                snapshot=pb.KvSnapshotChunk(index=index, count=self.count, num_blocks=len(items)))
            if index == 0:
                batch.events.add().cleared.SetInParent()
            add_events(batch.events, [StoredBlock(h, parent, tokens, a) for h, (parent, tokens), a in part],
                       publisher.block_size)
            done = self._chunks[index] = (batch, count_events(batch))
        return done


class Subscription:
    """One subscriber's view: a snapshot, then live batches from a bounded buffer."""

    def __init__(self, publisher: KvEventPublisher, snapshot: Snapshot) -> None:
        self._publisher = publisher
        self._snapshot: Snapshot | None = snapshot
        self._pending: collections.deque[tuple[pb.KvEventBatch, int]] = collections.deque()  # (batch, events)
        self._wakeup = asyncio.Event()
        self._dropped = False
        self._closed = False

    def offer(self, batch: pb.KvEventBatch, num_events: int) -> None:
        """Queue a live batch (of `num_events` events), or drop the subscription when its buffer is full.
        Never waits."""
        if len(self._pending) >= self._publisher.buffer:
            self._drop(num_events)
            return
        self._pending.append((batch, num_events))
        self._wakeup.set()

    def close(self) -> None:
        """End the subscription normally (its stream ends after what it already holds is not sent)."""
        self._closed = True
        self._publisher._forget(self)
        self._wakeup.set()

    async def batches(self) -> AsyncIterator[pb.KvEventBatch]:
        """The snapshot's chunks, then live batches in order. Raises SubscriberDropped once dropped; ends
        when closed."""
        counters = self._publisher.counters
        try:
            snapshot = self._snapshot
            assert snapshot is not None
            for index in range(snapshot.count):
                if self._dropped:
                    raise SubscriberDropped
                chunk, num_events = snapshot.chunk(index)
                counters.sent_events += num_events
                yield chunk
            self._snapshot = snapshot = None  # sent: the other subscriptions may still hold it
            while True:
                await self._wakeup.wait()
                self._wakeup.clear()
                while self._pending and not self._dropped:
                    batch, num_events = self._pending.popleft()
                    counters.sent_events += num_events
                    yield batch
                if self._dropped:
                    raise SubscriberDropped
                if self._closed:
                    return
        finally:
            self.close()

    def _drop(self, overflow_events: int) -> None:
        counters = self._publisher.counters
        counters.dropped_subscribers += 1
        counters.dropped_events += overflow_events + sum(n for _, n in self._pending)
        self._pending.clear()
        self._dropped = True
        self._publisher._forget(self)
        self._wakeup.set()


# ---- the mirror and the wire form ------------------------------------------------------------------------
def apply_to_mirror(mirror: dict[BlockHash, Entry], events: Iterable[KVEvent],
                    adapters: dict[BlockHash, BlockAdapter] | None = None) -> None:
    """Replay records onto `mirror` (hash -> (parent hash, token ids)), in order, and onto `adapters`
    (hash -> the LoRA adapter of a block stored under one) when given."""
    for event in events:
        if isinstance(event, StoredBlock):
            mirror[event.block_hash] = (event.parent_hash, event.token_ids)
            if adapters is not None and event.adapter is not None:
                adapters[event.block_hash] = event.adapter
        else:
            mirror.pop(event, None)
            if adapters:
                adapters.pop(event, None)


def add_events(out: Any, events: Sequence[KVEvent], block_size: int) -> None:
    """Append records to `out` (a repeated KvCacheEvent field, built in place) in order: a run of stored
    blocks that chain (each the parent of the next) under one adapter becomes one `stored` event (naming
    the adapter), a run of removals one `removed` event."""
    for is_store, run in itertools.groupby(events, key=lambda e: isinstance(e, StoredBlock)):
        if not is_store:
            out.add().removed.block_hashes.extend(run)
            continue
        stored: Any = None
        previous: BlockHash | None = None
        adapter: BlockAdapter | None = None
        for block in run:
            assert isinstance(block, StoredBlock)
            if (stored is None or block.parent_hash is None or block.parent_hash != previous
                    or block.adapter != adapter):
                stored = out.add().stored
                stored.parent_block_hash = block.parent_hash or b""
                stored.block_size = block_size
                adapter = block.adapter
                if adapter is not None:
                    stored.lora_name, stored.lora_id, stored.lora_fingerprint = adapter
            added = stored.blocks.add()
            added.block_hash = block.block_hash
            added.token_ids.extend(block.token_ids)
            previous = block.block_hash


def events_to_pb(events: Sequence[KVEvent], block_size: int) -> list[pb.KvCacheEvent]:
    """The records as a list of protobuf events (see `add_events`)."""
    batch = pb.KvEventBatch()
    add_events(batch.events, events, block_size)
    return list(batch.events)


def count_events(batch: pb.KvEventBatch) -> int:
    """Blocks stored or removed, and clears, in a batch (what the sent/dropped counters count)."""
    total = 0
    for event in batch.events:
        kind = event.WhichOneof("kind")
        if kind == "stored":
            total += len(event.stored.blocks)
        elif kind == "removed":
            total += len(event.removed.block_hashes)
        else:
            total += 1
    return total


async def stream_kv_events(publisher: KvEventPublisher | None,
                           context: grpc.aio.ServicerContext) -> AsyncIterator[pb.KvEventBatch]:
    """A subscription as a stream. Refusals end the call with a status set on it, not `context.abort`
    (whose exception grpc would keep, with this frame, until a full garbage collection)."""
    if publisher is None:
        _end(context, grpc.StatusCode.FAILED_PRECONDITION,
             "KV cache events are off on this engine (--no-enable-kv-cache-events)")
        return
    try:
        subscription = publisher.subscribe()
    except TooManySubscribers:
        _end(context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"this engine has {publisher.max_subscribers} KV event "
             "subscribers already (--max-kv-event-subscribers); retry later")
        return
    try:
        async for batch in subscription.batches():
            yield batch
    except SubscriberDropped:
        logger.warning("a KV event subscriber fell more than %d batches behind; dropped it", publisher.buffer)
        _end(context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"this subscriber fell more than {publisher.buffer} "
             "batches behind the engine's KV cache events and was dropped; subscribe again for a fresh snapshot")


def _end(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> None:
    context.set_code(code)
    context.set_details(details)
