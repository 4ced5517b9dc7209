"""What the prefix cache did, recorded where it happens (the block pool, on the busy-loop thread).

`KVEventLog` is the engine's cheapest possible record of the prefix cache's changes: the block pool
appends one tuple per block it caches and one hash per block it uncaches, and the busy loop hands the
list off once per iteration (`take`). Everything else - numbering, grouping into chains, protobuf,
per-subscriber buffers, snapshots - happens off the busy loop (engine_svc/kv_publisher.py).

Records, in the order they happened:
- `StoredBlock(block_hash, parent_hash, token_ids)`: a full block entered the cache (`parent_hash` is
  None for the first block of a sequence).
- a bare `bytes` hash: that block left the cache (evicted for reuse, or uncached because its K/V will
  never be written).
"""

from __future__ import annotations

from typing import NamedTuple

from shared_runtime.kv_hash import BlockHash


class StoredBlock(NamedTuple):
    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]


KVEvent = StoredBlock | BlockHash


class KVEventLog:
    """An append-only list of prefix-cache changes that one thread fills and hands off whole."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending: list[KVEvent] = []

    def stored(self, block_hash: BlockHash, parent_hash: BlockHash | None, token_ids: tuple[int, ...]) -> None:
        self._pending.append(StoredBlock(block_hash, parent_hash, token_ids))

    def removed(self, block_hash: BlockHash) -> None:
        self._pending.append(block_hash)

    def __len__(self) -> int:
        return len(self._pending)

    def take(self) -> list[KVEvent]:
        """Everything recorded since the last `take`, in order; the log starts empty again."""
        pending, self._pending = self._pending, []
        return pending
