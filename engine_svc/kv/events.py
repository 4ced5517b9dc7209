"""What the prefix cache did, recorded where it happens (the block pool, on the busy-loop thread).

`KVEventLog` is the engine's cheapest possible record of the prefix cache's changes: the block pool
appends one tuple per block it caches and one hash per block it uncaches. `KVEventHandOff` hands the
list off whole from the busy loop (a list swap and one call): after every step when steps are slower than
`HAND_OFF_INTERVAL_S`, else every `HAND_OFF_INTERVAL_S`, and at once when the engine goes idle, so short
steps do not each wake the server's event loop. Everything else - numbering, grouping into chains,
protobuf, per-subscriber buffers, snapshots - happens off the busy loop (engine_svc/api/kv_events.py).

Records, in the order they happened:
- `StoredBlock(block_hash, parent_hash, token_ids, adapter)`: a full block entered the cache
  (`parent_hash` is None for the first block of a sequence; `adapter` is the LoRA adapter it was computed
  under, None for the base model).
- a bare `bytes` hash: that block left the cache (evicted for reuse, or uncached because its K/V will
  never be written).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

from shared_runtime.kv_hash import BlockHash

HAND_OFF_INTERVAL_S = 0.01  # the longest records wait while the engine is busy (plus one step)


class BlockAdapter(NamedTuple):
    """The LoRA adapter a block's K/V was computed under (its fingerprint is in the block's hash)."""

    name: str
    lora_id: int
    fingerprint: str


class StoredBlock(NamedTuple):
    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    adapter: BlockAdapter | None = None


KVEvent = StoredBlock | BlockHash


class KVEventLog:
    """An append-only list of prefix-cache changes that one thread fills and hands off whole."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending: list[KVEvent] = []

    def stored(self, block_hash: BlockHash, parent_hash: BlockHash | None, token_ids: tuple[int, ...],
               adapter: BlockAdapter | None = None) -> None:
        self._pending.append(StoredBlock(block_hash, parent_hash, token_ids, adapter))

    def removed(self, block_hash: BlockHash) -> None:
        self._pending.append(block_hash)

    def __len__(self) -> int:
        return len(self._pending)

    def take(self) -> list[KVEvent]:
        """Everything recorded since the last `take`, in order; the log starts empty again."""
        pending, self._pending = self._pending, []
        return pending


class KVEventHandOff:
    """Moves a log's records to `sink(records, stats)`: at most every `interval_s` while the engine is busy,
    at once when it is idle. Called by the busy loop after every iteration; costs a length check when the
    log is empty and a clock read otherwise."""

    __slots__ = ("_due", "_interval_s", "_log", "_sink")

    def __init__(self, log: KVEventLog, sink: Callable[[list[KVEvent], object], None],
                 interval_s: float = HAND_OFF_INTERVAL_S) -> None:
        self._log, self._sink, self._interval_s = log, sink, interval_s
        self._due = 0.0

    def __call__(self, stats: object, idle: bool) -> None:
        if not self._log:
            return
        now = time.monotonic()
        if idle or now >= self._due:
            self._sink(self._log.take(), stats)
            self._due = now + self._interval_s
