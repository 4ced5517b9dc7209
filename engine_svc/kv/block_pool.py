"""The pool of fixed-size KV blocks: ref counts, the free queue, and the prefix-cache map.

Invariants:
- Block ids are 0..num_blocks-1; no id is reserved.
- A block is in the free queue iff its `ref_cnt == 0`. Allocation takes from the head of the queue,
  freeing appends to the tail, so free blocks are reused in LRU order.
- A block with a `block_hash` is in `cached` under that hash (and holds `token_ids`), whether it is in use
  or free. A free cached block stays findable until it is reallocated (evicted); a prefix hit on it takes
  it out of the middle of the free queue (`touch`).
- With an `events` log, every change of `cached` is recorded there as it happens, in order: one stored
  record per `cache_block` that cached, one removed record per `uncache` of a cached block. The log's
  records replayed from empty give exactly the keys of `cached` that are plain block hashes: keys with a
  group tag appended (hybrid KV groups' sliding layers, engine_svc/kv/hybrid_manager.py) are not
  reported, so the log speaks of the full-attention layers' blocks, which hold whole prefixes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from engine_svc.kv.block_hash import BlockHash, hash_block_tokens
from engine_svc.kv.events import BlockAdapter, KVEventLog

_HASH_LEN = len(hash_block_tokens(None, ()))  # a plain block hash's length: longer keys carry a group tag


class KVCacheBlock:
    """One block of `block_size` token slots. `prev_free`/`next_free` link it into the free queue."""

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.token_ids: tuple[int, ...] = ()  # the tokens it holds, only while cached
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) popleft, append and removal from the middle.

    Uses sentinel head/tail nodes (id -1) so no operation needs a special case for an empty list.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        block.prev_free, block.next_free = last, self._tail
        last.next_free = block
        self._tail.prev_free = block
        self._len += 1

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def block_ids(self) -> list[int]:
        """Ids from head (next to be allocated) to tail. O(n); for tests and debugging."""
        ids = []
        node = self._head.next_free
        while node is not None and node is not self._tail:
            ids.append(node.block_id)
            node = node.next_free
        return ids


class PoolGauges:
    """`num_blocks`, `num_free_blocks` and `usage` of a KV manager, read from its `pool`."""

    pool: BlockPool

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Blocks in use (ref_cnt > 0) / total blocks."""
        return self.pool.usage


class BlockPool:
    def __init__(self, num_blocks: int, events: KVEventLog | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        self.events = events  # None: nobody listens, nothing is recorded

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (ref_cnt > 0)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take `n` blocks from the head of the free queue (evicting their cache entries); ref_cnt = 1."""
        if n > len(self.free_queue):
            raise ValueError(f"asked for {n} blocks, only {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self.uncache(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found in the cache; free ones leave the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the tail of the free queue in order.

        Pass a request's blocks last-first, so its prefix (the most shareable part) is evicted last.
        """
        for block in ordered:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"double free of {block}"
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def get_cached_block(self, block_hash: BlockHash, token_ids: Sequence[int]) -> KVCacheBlock | None:
        """The cached block for this hash, only if it also holds exactly `token_ids` (collision guard)."""
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash, token_ids: Sequence[int],
                    parent: BlockHash | None = None, adapter: BlockAdapter | None = None) -> bool:
        """Register a full, in-use block under its hash (`parent`: the hash of the block before it, None
        for a first block; `adapter`: the LoRA adapter it was computed under; both only reported to the
        event log). Returns False (and leaves the block uncached)
        when the block is cached already or another block holds this hash (a duplicate computed
        separately)."""
        if block.block_hash is not None or block_hash in self.cached:
            return False
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self.cached[block_hash] = block
        if self.events is not None and len(block_hash) == _HASH_LEN:
            self.events.stored(block_hash, parent, block.token_ids, adapter)
        return True

    def uncache(self, block: KVCacheBlock) -> None:
        """Drop the block's cache entry, if any (its contents are not, or no longer, valid)."""
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            if self.events is not None and len(block.block_hash) == _HASH_LEN:
                self.events.removed(block.block_hash)
            block.block_hash = None
            block.token_ids = ()
