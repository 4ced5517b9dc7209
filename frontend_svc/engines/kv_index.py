"""A frontend's view of one engine's prefix cache, kept exact by the engine's KV-cache event stream.

`KvBlockIndex` is the set of block hashes (shared_runtime/kv_hash.py) the engine holds. `follow_kv_events`
subscribes to the engine's `SubscribeKvEvents` and applies what arrives; cache-aware routing
(router.py) looks a prompt's block hashes up in it.

Invariants:
- After the last chunk of a snapshot, `blocks` is exactly the engine's cache as of the snapshot's
  sequence number; after each live batch, exactly its cache as of that batch. While a snapshot is
  arriving the previous view stays in place (chunks are staged, then swapped in at once).
- A batch whose number is not one past the previous one (events were lost), or from another engine
  process, empties the index and raises `KvEventGap`: the subscriber subscribes again and gets a fresh
  snapshot, so the view is never silently wrong.
- An index whose engine is gone (stream ended, engine restarted or dropped) is emptied by its owner
  (engine_client.py) at once: no request is routed by a cache that no longer exists.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from typing import Any

import grpc
from tandem.engine.v1 import engine_core_pb2 as epb
from tandem.engine.v1 import engine_core_pb2_grpc as epb_grpc

logger = logging.getLogger(__name__)

RESUBSCRIBE_INITIAL_S = 0.05
RESUBSCRIBE_MAX_S = 2.0
_NOT_SERVED = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION)


class KvEventGap(Exception):
    """The stream skipped events (or changed engine process): the index was emptied; resubscribe."""


class KvBlockIndex:
    """The block hashes one engine's prefix cache holds, as its event stream describes them."""

    def __init__(self) -> None:
        self.blocks: set[bytes] = set()
        self.sequence: int | None = None  # number of the last batch applied (None: no snapshot yet)
        self.engine_id = ""
        self._staged: set[bytes] | None = None  # a snapshot being received

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def clear(self) -> None:
        """Forget everything (the engine went away, or the stream must start over)."""
        self.blocks = set()
        self.sequence = None
        self.engine_id = ""
        self._staged = None

    def apply(self, batch: epb.KvEventBatch) -> None:
        """One message of the stream; raises KvEventGap (after emptying the index) when events were lost."""
        if batch.HasField("snapshot"):
            self._apply_snapshot_chunk(batch)
            return
        if self.sequence is None or self._staged is not None:
            self._gap("a live batch before the snapshot was complete")
        if batch.engine_id != self.engine_id:
            self._gap(f"events from engine process {batch.engine_id!r}, not {self.engine_id!r}")
        if batch.sequence_number != self.sequence + 1:  # type: ignore[operator]
            self._gap(f"batch {batch.sequence_number} after batch {self.sequence}")
        apply_events(self.blocks, batch.events)
        self.sequence = batch.sequence_number

    def _apply_snapshot_chunk(self, batch: epb.KvEventBatch) -> None:
        chunk = batch.snapshot
        if chunk.index == 0:
            self._staged = set()
        elif self._staged is None or batch.sequence_number != self.sequence or batch.engine_id != self.engine_id:
            self._gap(f"snapshot chunk {chunk.index} of {chunk.count} without its beginning")
        assert self._staged is not None
        self.sequence, self.engine_id = batch.sequence_number, batch.engine_id
        apply_events(self._staged, batch.events)
        if chunk.index + 1 == chunk.count:
            self.blocks, self._staged = self._staged, None

    def _gap(self, why: str) -> None:
        self.clear()
        raise KvEventGap(why)


def apply_events(blocks: set[bytes], events: Any) -> None:
    """Replay `KvCacheEvent`s onto a set of block hashes, in order."""
    for event in events:
        kind = event.WhichOneof("kind")
        if kind == "stored":
            blocks.update(block.block_hash for block in event.stored.blocks)
        elif kind == "removed":
            blocks.difference_update(event.removed.block_hashes)
        elif kind == "cleared":
            blocks.clear()


async def follow_kv_events(stub: epb_grpc.EngineCoreServiceStub, index: KvBlockIndex, address: str,
                           on_stats: Callable[[epb.SchedulerStats], None] = lambda stats: None) -> None:
    """Keep `index` exact until cancelled: subscribe, apply every batch, and subscribe again (after a short
    backoff, with the index emptied) when the stream ends, skips events or drops this subscriber. Returns
    only if the engine does not serve KV events (an older engine, or events turned off)."""
    backoff = RESUBSCRIBE_INITIAL_S
    while True:
        try:
            async for batch in stub.SubscribeKvEvents(epb.SubscribeKvEventsRequest()):
                index.apply(batch)
                if batch.HasField("scheduler_stats"):
                    on_stats(batch.scheduler_stats)
                backoff = RESUBSCRIBE_INITIAL_S
            reason = "the engine ended the stream"
        except KvEventGap as exc:
            reason = f"events were lost ({exc})"
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _NOT_SERVED:
                logger.info("engine %s serves no KV cache events (%s); routing to it without its cache view",
                            address, exc.details())
                index.clear()
                return
            reason = f"{exc.code().name}: {exc.details()}"
        index.clear()
        logger.warning("engine %s: KV cache event stream restarts: %s", address, reason)
        await asyncio.sleep(backoff * random.uniform(0.8, 1.2))
        backoff = min(backoff * 2, RESUBSCRIBE_MAX_S)
