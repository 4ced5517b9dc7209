"""Block tables per KV group over one shared pool, for hybrid models (engine_svc/kv/groups.py).

One `KVCacheManager` per group, all over one `BlockPool`: a full-attention group keeps a block for every
block of positions; a sliding group (window W, each its own) gives back, before each allocation, its
blocks wholly below q0 - W + 1 for a step computing from q0 = num_computed_tokens, leaving `NULL_BLOCK` in
their entries (kv_cache_manager.py says why the workers need not be told). This class coordinates them:
- Every group's table has one entry per block of positions: the tables grow together, so a step that
  needs n more blocks of positions takes n blocks per group (and the hits it claims), all or none.
- The pool's free count is the one budget: the scheduler admits and preempts by it, and a request of T
  tokens never needs more than `num_groups * ceil(T / block_size)` blocks (`num_groups` is what the
  scheduler divides the pool by for the longest request it accepts).
- `free` returns every block the request holds in any group (finish, abort, preemption).
- Block ids and prefix hits are interleaved (entry i * num_groups + g: group g's block i), as the
  workers receive the tables.
- Prefix caching (vLLM's `find_longest_cache_hit` over several attention types): each group caches its
  blocks under the block hash with its own tag appended (`cache_tag`: none for group 0, byte g for group
  g), so the groups' blocks of one prefix are told apart (and KV events report group 0's only). A hit of
  L blocks needs, in each full group, blocks 0 .. L - 1 cached and, in each sliding group, the blocks
  that position L * block_size's window reads. Each group's `longest_hit` is the longest hit it allows
  up to a bound; the bound starts at the prompt's blocks and is lowered group after group until a pass
  over every group leaves it unchanged (a full group allows every shorter hit; a sliding group is asked
  again under the lower bound, since its window blocks move). The counters count each admission once
  (group 0's).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine_svc.kv.block_pool import BlockPool, KVCacheBlock, PoolGauges
from engine_svc.kv.events import KVEventLog
from engine_svc.kv.kv_cache_manager import KVCacheManager
from engine_svc.request import Request


class HybridKVCacheManager(PoolGauges):
    sliding_window = None  # no window every layer shares: the groups' windows are `windows`

    def __init__(self, num_blocks: int, block_size: int, windows: Sequence[int | None],
                 enable_prefix_caching: bool = True, events: KVEventLog | None = None) -> None:
        if len(windows) < 2 or any(w is not None and w < 1 for w in windows):
            raise ValueError(f"hybrid KV groups need two groups or more, each full or a positive window, "
                             f"got windows {tuple(windows)}")
        self.block_size = block_size
        self.windows = tuple(windows)
        self.num_groups = len(self.windows)
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, events)
        self.groups = [KVCacheManager(num_blocks, block_size, enable_prefix_caching, sliding_window=w,
                                      pool=self.pool, cache_tag=bytes((g,)) if g else b"")
                       for g, w in enumerate(self.windows)]
        self._sliding = [g for g in self.groups if g.sliding_window is not None]

    @property
    def prefix_cache_queries(self) -> int:
        return self.groups[0].prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.groups[0].prefix_cache_hits

    def get_block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """The request's interleaved tables from flat index `start` on ([] for an unknown request)."""
        tables = [g._tables.get(request_id) for g in self.groups]
        if tables[0] is None or len(tables[0]) * self.num_groups <= start:
            return []
        n = self.num_groups
        flat = [t[i].block_id for i in range(start // n, len(tables[0])) for t in tables if t is not None]
        return flat[start % n :]

    def hash_blocks(self, request: Request) -> None:
        self.groups[0].hash_blocks(request)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest prefix cached for every group, as (interleaved blocks, num_tokens); pure lookup."""
        first = self.groups[0]
        if not first.uses_lookup(request):
            return [], 0
        first.hash_blocks(request)
        bound = (request.num_tokens - 1) // self.block_size
        hits: list[list[KVCacheBlock]] = []  # each group's hit of `bound` blocks, groups 0 .. len - 1
        while bound and len(hits) < self.num_groups:
            found = self.groups[len(hits)].longest_hit(request, bound)
            if len(found) < bound:  # a lower bound: every group is asked again under it
                bound, hits = len(found), []
                continue
            hits.append(found)
        if not bound:
            return [], 0
        return [b for row in zip(*hits) for b in row], bound * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] | None = None) -> list[int] | None:
        """Grow every group's table to hold `num_computed_tokens + hits + num_new_tokens` tokens, after
        the sliding group gives back what lies behind its window. Returns the interleaved ids appended
        (hits first), or None (nothing taken) when the pool has fewer free blocks than the groups need."""
        rid = request.request_id
        tables = [g._tables.get(rid) for g in self.groups]
        num_computed = request.num_computed_tokens
        if tables[0] is not None:
            for g in self._sliding:
                g._free_behind_window(rid, g._tables[rid], num_computed)
        if tables[0] is not None and not new_computed_blocks:
            # Fast path (a decode, most steps): no group takes a block or caches one.
            num_tokens, bs = num_computed + num_new_tokens, self.block_size
            if num_tokens <= len(tables[0]) * bs and (num_tokens // bs == num_computed // bs
                                                       or not self.enable_prefix_caching):
                return []
        hits = list(new_computed_blocks or ())
        plans = [g.plan_allocation(request, num_new_tokens, hits[i::self.num_groups], t)
                 for i, (g, t) in enumerate(zip(self.groups, tables))]
        if sum(p.num_new_blocks + p.num_hits_in_free_queue for p in plans) > self.pool.num_free_blocks:
            return None
        for plan in plans:  # every group's hits leave the free queue before any group takes a new block
            self.pool.touch(plan.taken)
        added = [g.commit_allocation(request, p, t, touched=True) for g, p, t in zip(self.groups, plans, tables)]
        return [ids[i] for i in range(len(added[0])) for ids in added]

    def cache_late_blocks(self, request: Request) -> None:
        for g in self.groups:
            g.cache_late_blocks(request)

    def free(self, request: Request) -> None:
        """Give back every block the request holds, in every group."""
        for g in self.groups:
            g.free(request)
