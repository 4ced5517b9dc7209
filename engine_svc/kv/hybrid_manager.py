"""Block tables per KV group over one shared pool, for hybrid models (engine_svc/kv/groups.py).

Each request holds one table per group: group 0 (full attention) keeps a block for every block of
positions; group 1 (sliding window W) gives back, before each allocation, its blocks wholly below
q0 - W + 1 for a step computing from q0 = num_computed_tokens (no query from q0 on reads them), leaving
`NULL_BLOCK` in their entries, as the one-table sliding-window cache does (kv_cache_manager.py says why
the workers need not be told). Invariants:
- Every group's table has one entry per block of positions: the tables grow together, so a step that
  needs n more blocks of positions takes n blocks per group, `num_groups * n` from the pool, all or none.
- The pool's free count is the one budget: the scheduler admits and preempts by it, and a request of T
  tokens never needs more than `num_groups * ceil(T / block_size)` blocks (`num_groups` is what the
  scheduler divides the pool by for the longest request it accepts).
- `free` returns every block the request holds in any group (finish, abort, preemption).
- Block ids reach the workers interleaved (entry i * num_groups + g: group g's block i).
- Prefix caching is not supported: the engine configures these groups only with prefix caching off
  (engine_svc/config.py), so lookups find nothing and nothing is cached.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine_svc.kv.block_pool import BlockPool, KVCacheBlock
from engine_svc.kv.kv_cache_manager import NULL_BLOCK
from engine_svc.request import Request


class HybridKVCacheManager:
    enable_prefix_caching = False
    sliding_window = None  # no window every layer shares: the groups' windows are `windows`
    prefix_cache_queries = 0  # no lookups: prefix caching is off
    prefix_cache_hits = 0

    def __init__(self, num_blocks: int, block_size: int, windows: Sequence[int | None]) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if len(windows) < 2 or any(w is not None and w < 1 for w in windows):
            raise ValueError(f"hybrid KV groups need two or more groups with positive windows, got {windows}")
        self.block_size = block_size
        self.windows = tuple(windows)
        self.num_groups = len(self.windows)
        self._sliding = [(g, w) for g, w in enumerate(self.windows) if w is not None]
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[list[KVCacheBlock]]] = {}  # request id -> one table per group
        self._num_freed: dict[tuple[str, int], int] = {}  # (request id, group) -> leading NULL_BLOCK entries

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """The request's interleaved table from flat index `start` on ([] for an unknown request)."""
        tables = self._tables.get(request_id)
        if tables is None or len(tables[0]) * self.num_groups <= start:
            return []
        g = self.num_groups
        flat = [t[i].block_id for i in range(start // g, len(tables[0])) for t in tables]
        return flat[start % g :]

    def group_block_ids(self, request_id: str, group: int) -> list[int]:
        """Group `group`'s table of the request (NULL_BLOCK's id 0 where freed)."""
        tables = self._tables.get(request_id)
        return [] if tables is None else [b.block_id for b in tables[group]]

    def hash_blocks(self, request: Request) -> None:
        """No-op: nothing is cached."""

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """No hit: nothing is cached."""
        return [], 0

    def cache_late_blocks(self, request: Request) -> None:
        """No-op: nothing is cached."""

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] | None = None) -> list[int] | None:
        """Grow every group's table to hold `num_computed_tokens + num_new_tokens` tokens, after the
        sliding groups give back what lies behind their windows. Returns the interleaved ids appended, or
        None (nothing taken) when the pool has fewer free blocks than all groups need together."""
        if new_computed_blocks:
            raise ValueError(f"{request.request_id}: hybrid KV groups take no prefix-cache hits")
        rid = request.request_id
        num_computed = request.num_computed_tokens
        tables = self._tables.get(rid)
        if tables is not None:
            for g, window in self._sliding:
                self._free_behind_window(rid, g, tables[g], num_computed, window)
            held = len(tables[0])
        else:
            held = 0
        need = max(0, -(-(num_computed + num_new_tokens) // self.block_size) - held)
        if need == 0:
            if tables is None:
                self._tables[rid] = [[] for _ in self.windows]
            return []
        if need * self.num_groups > self.pool.num_free_blocks:
            return None
        if tables is None:
            tables = self._tables[rid] = [[] for _ in self.windows]
        new = [self.pool.get_new_blocks(need) for _ in tables]
        for table, blocks in zip(tables, new):
            table.extend(blocks)
        return [blocks[i].block_id for i in range(need) for blocks in new]

    def free(self, request: Request) -> None:
        """Give back every block the request holds, in every group, last block first."""
        rid = request.request_id
        tables = self._tables.pop(rid, None)
        if tables is None:
            return
        for g, table in enumerate(tables):
            done = self._num_freed.pop((rid, g), 0)
            self.pool.free_blocks(reversed(table[done:]))

    def _free_behind_window(self, rid: str, group: int, table: list[KVCacheBlock], num_computed: int,
                            window: int) -> None:
        """Return group `group`'s blocks wholly below num_computed - window + 1, oldest first, leaving
        `NULL_BLOCK` in their entries. Two compares when there is none."""
        if num_computed < window:
            return
        behind = min((num_computed - window + 1) // self.block_size, len(table))
        key = (rid, group)
        done = self._num_freed.get(key, 0)
        if behind <= done:
            return
        freed = table[done:behind]
        table[done:behind] = [NULL_BLOCK] * (behind - done)
        self._num_freed[key] = behind
        self.pool.free_blocks(freed)
