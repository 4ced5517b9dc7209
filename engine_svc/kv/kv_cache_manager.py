"""Per-request block tables on top of the block pool, with prefix caching.

Each request owns a block table: block `i` holds the K/V of tokens `[i*block_size, (i+1)*block_size)`.

Prefix caching (when enabled):
- `request.block_hashes` holds the chained hashes of the full blocks of `all_token_ids`; it is extended
  lazily here (`hash_blocks`) whenever the manager looks at a request, so it always covers every full block.
- A block is put in the cache map as soon as it is allocated for tokens that fill it: its K/V is written
  in the step that the allocation is for, before any attention reads it (backends write K/V, then attend),
  so a request admitted in the same step may already share it. If that step is undone for the request
  (preempted in the same `schedule()`), `free` drops those entries again.
- Lookup (`get_computed_blocks`) walks the hash chain and stops at the first miss; each hit must also hold
  exactly the request's tokens (guards against hash collisions). The hit is capped at `num_tokens - 1`
  tokens, rounded down to whole blocks: a prompt whose every block is cached recomputes its whole last
  block, so the model always runs at least one token and produces the next token's logits.
- Under async scheduling a block may be filled by a token the scheduler does not know yet (an output
  placeholder, engine_svc/sched/output.py): it has no hash then, so it is not cached at allocation.
  `cache_late_blocks` caches it once the token is known, if its K/V is computed or being computed
  (a hash is only ever made of real tokens).
- Requests that ask for prompt logprobs skip the lookup (those logprobs need every prompt position run);
  their full blocks are still cached for others.
- With `events` (a `KVEventLog`), the pool records every block entering or leaving the cache, with its
  parent's hash and its tokens (engine_svc/kv/events.py).
- Sliding window (`sliding_window` W, set only when every attention layer slides over the same W,
  engine_svc/model/windows.py): a query at position p reads keys p - W < k <= p only, and positions only
  grow, so before a step that computes from position q0 = num_computed_tokens the blocks wholly below
  q0 - W + 1 are never read again. They go back to the pool (`_free_behind_window`, run by every
  allocation before it counts free blocks), and their table entries become `NULL_BLOCK`, a placeholder
  that is no block of the pool: the table keeps one entry per block of positions, so indices stay
  positions. The workers are not told: their tables keep the old ids, which no kernel reads again (the
  attention backends start each request's keys at its window) and no slot mapping writes (writes go to
  positions >= q0). A request thus holds about W / block_size + its step's blocks, however long it grows,
  and the scheduler, which admits by free blocks, fits more of them.
  Prefix caching stays exact: a freed block keeps its cache entry and its K/V until the pool hands it
  out again (which uncaches it), so a hit on it reads exactly the K/V its hash promises. The lookup
  (`_window_hit`, vLLM's rule) needs only the blocks the first computed position's window reads to be
  cached: the blocks before them come back as `NULL_BLOCK` placeholders, and the hits behind the new
  request's window are not taken (their table entries are `NULL_BLOCK` at once). `NULL_BLOCK` is never
  cached, freed or referenced.
- Counters (in tokens, like vLLM): at each successful admission (first schedule, and again at each resume
  after a preemption) `prefix_cache_queries += num_tokens` and `prefix_cache_hits += hit tokens`. A request
  whose lookup is skipped counts nothing. With prefix caching off both stay 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from engine_svc.kv.block_hash import extend_block_hashes
from engine_svc.kv.block_pool import BlockPool, KVCacheBlock, PoolGauges
from engine_svc.kv.events import BlockAdapter, KVEventLog
from engine_svc.request import Request


class AllocationPlan(NamedTuple):
    """One allocation, planned (`KVCacheManager.plan_allocation`) before it takes anything."""

    computed: list[KVCacheBlock]  # the prefix-cache hits given at admission
    taken: list[KVCacheBlock]  # those the table takes a reference on (not behind the window)
    num_behind: int  # leading hits behind the window: NULL_BLOCK entries
    num_new_blocks: int  # blocks taken from the free queue
    num_hits_in_free_queue: int  # taken hits that leave the free queue too
    num_computed: int  # tokens computed once the hits count
    num_tokens: int  # tokens the table holds afterwards


# The table entry of a block freed behind the sliding window. Its id (0) is only ever sent to workers in a
# full table (admission, resume) for positions no kernel reads; it belongs to no pool.
NULL_BLOCK = KVCacheBlock(0)


class KVCacheManager(PoolGauges):
    num_groups = 1  # one table per request for every layer (engine_svc/kv/hybrid_manager.py: one per group)

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 events: KVEventLog | None = None, sliding_window: int | None = None,
                 pool: BlockPool | None = None, cache_tag: bytes = b"") -> None:
        """`pool`: a pool shared with other managers (hybrid KV groups, engine_svc/kv/hybrid_manager.py;
        `num_blocks` and `events` are then the pool's); `cache_tag`: appended to this manager's block
        hashes in the pool's cache map, so groups sharing a pool keep apart the blocks of one prefix."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self._num_freed: dict[str, int] = {}  # request id -> leading table entries that are NULL_BLOCK
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = pool if pool is not None else BlockPool(num_blocks, events)
        self.cache_tag = cache_tag
        self._tables: dict[str, list[KVCacheBlock]] = {}
        # request id -> index of its first full block left uncached at allocation for want of a hash
        self._late: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def get_block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """The request's block table from index `start` on ([] for an unknown request)."""
        table = self._tables.get(request_id)
        if table is None or len(table) <= start:
            return []  # most decode steps: no block added since the last look
        return [b.block_id for b in table[start:]]

    def hash_blocks(self, request: Request) -> None:
        """Bring `request.block_hashes` up to date with its tokens (no-op when prefix caching is off)."""
        if self.enable_prefix_caching:
            extend_block_hashes(request, self.block_size, request.block_hash_extra_keys)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request, as (blocks, num_tokens). Pure lookup: takes no
        references; pass the blocks to `allocate_slots` to claim them."""
        if not self.uses_lookup(request):
            return [], 0
        self.hash_blocks(request)
        hits = self.longest_hit(request, (request.num_tokens - 1) // self.block_size)
        return hits, len(hits) * self.block_size

    def longest_hit(self, request: Request, max_blocks: int) -> list[KVCacheBlock]:
        """The longest run of this table's leading blocks cached for the request, at most `max_blocks`
        (under a sliding window, `window_hit`'s). `request.block_hashes` must be current."""
        if self.sliding_window is not None:
            return self.window_hit(request, max_blocks)[0]
        bs, tokens = self.block_size, request.all_token_ids
        hits: list[KVCacheBlock] = []
        for i, block_hash in enumerate(request.block_hashes[:max_blocks]):
            block = self.pool.get_cached_block(block_hash + self.cache_tag, tokens[i * bs : (i + 1) * bs])
            if block is None:
                break
            hits.append(block)
        return hits

    def window_hit(self, request: Request, max_blocks: int) -> tuple[list[KVCacheBlock], int]:
        """The longest hit under a sliding window (vLLM's rule): L blocks are a hit when the
        ceil((W - 1) / block_size) blocks before block L, the keys position L * block_size reads, are all
        cached (or blocks 0 .. L - 1 are). Blocks before those are `NULL_BLOCK`: nothing reads them. The
        chained hash of a cached block stands for its whole prefix, so its K/V is the request's."""
        bs = self.block_size
        assert self.sliding_window is not None
        need = max(1, -(-(self.sliding_window - 1) // bs))
        tokens, hashes, tag = request.all_token_ids, request.block_hashes, self.cache_tag
        run: list[KVCacheBlock] = []  # cached blocks found walking back from `end`, nearest first
        end = max_blocks
        for i in range(max_blocks - 1, -1, -1):
            block = self.pool.get_cached_block(hashes[i] + tag, tokens[i * bs : (i + 1) * bs])
            if block is None:
                run, end = [], i
                continue
            run.append(block)
            if len(run) >= need:
                break
        if len(run) < need and end != len(run):
            return [], 0  # no run long enough, and the blocks from 0 are not all cached
        return [NULL_BLOCK] * (end - len(run)) + run[::-1], end * bs

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[KVCacheBlock] | None = None
    ) -> list[int] | None:
        """Grow the request's table to hold `num_computed_tokens + hits + num_new_tokens` tokens.

        `new_computed_blocks` (the hits from `get_computed_blocks`) may only be given at admission, i.e.
        while the request has no table; `request.num_computed_tokens` must not include them yet.
        Returns the block ids appended to the table (hits first), or None when there are not enough free
        blocks, in which case nothing changed but the freeing of blocks behind a sliding window (which
        no step from `num_computed_tokens` on reads: it is done first, so they count as free).
        """
        table = self._tables.get(request.request_id)
        if table is not None and self.sliding_window is not None:
            self._free_behind_window(request.request_id, table, request.num_computed_tokens)
        if table is not None and not new_computed_blocks:
            # Fast path (a decode, most steps): the tokens fit in the blocks held and fill none of them, so
            # `_allocate` would take no block and cache none (the request's hashes are already current).
            num_computed = request.num_computed_tokens
            num_tokens = num_computed + num_new_tokens
            bs = self.block_size
            if num_tokens <= len(table) * bs and (num_tokens // bs == num_computed // bs
                                                  or not self.enable_prefix_caching):
                return []
        return self._allocate(request, num_new_tokens, new_computed_blocks, table)

    def _allocate(self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[KVCacheBlock] | None,
                  table: list[KVCacheBlock] | None) -> list[int] | None:
        """`allocate_slots` in general: `table` is the request's table (None before admission)."""
        plan = self.plan_allocation(request, num_new_tokens, new_computed_blocks, table)
        if plan.num_new_blocks > self.pool.num_free_blocks - plan.num_hits_in_free_queue:
            return None
        return self.commit_allocation(request, plan, table)

    def plan_allocation(self, request: Request, num_new_tokens: int,
                        new_computed_blocks: Sequence[KVCacheBlock] | None,
                        table: list[KVCacheBlock] | None) -> AllocationPlan:
        """What `allocate_slots` takes from the pool (nothing changes); `commit_allocation` takes it."""
        computed = list(new_computed_blocks or ())
        if computed and table is not None:
            raise ValueError(f"{request.request_id}: computed blocks can only be added at admission")
        bs = self.block_size
        num_held = len(table or ()) + len(computed)
        num_computed = request.num_computed_tokens + len(computed) * bs
        num_tokens = num_computed + num_new_tokens
        num_new_blocks = max(0, -(-num_tokens // bs) - num_held)
        num_behind = self._num_behind_window(num_computed) if table is None else 0
        taken = computed[num_behind:]  # hits behind the window are not taken (see the module docstring)
        num_hits_in_free_queue = sum(1 for b in taken if b.ref_cnt == 0)
        return AllocationPlan(computed, taken, num_behind, num_new_blocks, num_hits_in_free_queue,
                              num_computed, num_tokens)

    def commit_allocation(self, request: Request, plan: AllocationPlan, table: list[KVCacheBlock] | None,
                          touched: bool = False) -> list[int]:
        """Take what `plan` says (the caller checked the pool has it); the block ids appended. `touched`:
        the caller already took its hits out of the free queue (before any new block is taken, which
        could otherwise evict a hit still waiting there)."""
        computed, taken, num_behind = plan.computed, plan.taken, plan.num_behind
        num_new_blocks, num_computed, num_tokens = plan.num_new_blocks, plan.num_computed, plan.num_tokens
        bs = self.block_size
        if not touched:
            self.pool.touch(taken)
        added = [NULL_BLOCK] * min(num_behind, len(computed)) + taken + self.pool.get_new_blocks(num_new_blocks)
        if table is None:
            table = self._tables[request.request_id] = []
            self._count_prefix_query(request, len(computed) * bs)
            if num_behind and computed:
                self._num_freed[request.request_id] = min(num_behind, len(computed))
        table.extend(added)
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, table, num_computed // bs, num_tokens // bs)
        return [b.block_id for b in added]

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first (so its prefix is evicted last).

        Blocks past `request.num_computed_tokens` that only this request holds lose their cache entry:
        they were cached at allocation for a step that will not run for this request (a request preempted
        in the very step that allocated them), so their K/V is never written.
        """
        table = self._tables.pop(request.request_id, None)
        self._late.pop(request.request_id, None)
        num_freed = self._num_freed.pop(request.request_id, 0)
        if not table:
            return
        for block in table[max(num_freed, request.num_computed_tokens // self.block_size) :]:
            if block.ref_cnt == 1:
                self.pool.uncache(block)
        self.pool.free_blocks(reversed(table[num_freed:]))

    def _num_behind_window(self, num_computed: int) -> int:
        """How many leading blocks no query from position `num_computed` on reads (0 without a window)."""
        window = self.sliding_window
        if window is None or num_computed < window:
            return 0
        return (num_computed - window + 1) // self.block_size

    def _free_behind_window(self, request_id: str, table: list[KVCacheBlock], num_computed: int) -> None:
        """Return the request's blocks that lie wholly behind its window to the pool, oldest first,
        leaving `NULL_BLOCK` in their table entries. Cheap (two compares) when there is none."""
        done = self._num_freed.get(request_id, 0)
        behind = min(self._num_behind_window(num_computed), len(table))
        if behind <= done:
            return
        freed = table[done:behind]
        table[done:behind] = [NULL_BLOCK] * (behind - done)
        self._num_freed[request_id] = behind
        self.pool.free_blocks(b for b in freed if b is not NULL_BLOCK)

    def uses_lookup(self, request: Request) -> bool:
        return self.enable_prefix_caching and request.sampling_params.prompt_logprobs is None

    def _count_prefix_query(self, request: Request, num_hit_tokens: int) -> None:
        if self.uses_lookup(request):
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def _cache_full_blocks(self, request: Request, table: list[KVCacheBlock], start: int, end: int) -> None:
        """Cache table[start:end]: blocks that this allocation fills. Earlier ones were cached by earlier
        allocations (or are hits); a block whose hash another block already holds stays uncached."""
        self.hash_blocks(request)
        hashes = request.block_hashes
        self._cache_range(request, table, start, min(end, len(hashes)))
        if end > len(hashes) and request.request_id not in self._late:
            self._late[request.request_id] = max(start, len(hashes))  # filled by tokens not known yet

    def cache_late_blocks(self, request: Request) -> None:
        """Cache the request's full blocks that were left uncached at allocation because a token in them
        was not known yet, as far as its tokens are known now and its K/V is scheduled
        (`num_computed_tokens`). Cheap when there are none."""
        start = self._late.get(request.request_id)
        if start is None:
            return
        table = self._tables.get(request.request_id)
        if table is None:
            del self._late[request.request_id]
            return
        self.hash_blocks(request)
        end = min(request.num_computed_tokens // self.block_size, len(table))
        stop = min(end, len(request.block_hashes))
        self._cache_range(request, table, start, stop)
        if stop >= end:
            del self._late[request.request_id]
        else:
            self._late[request.request_id] = stop

    def _cache_range(self, request: Request, table: list[KVCacheBlock], start: int, stop: int) -> None:
        bs = self.block_size
        hashes, tokens = request.block_hashes, request.all_token_ids
        adapter = (BlockAdapter(request.lora_name, request.lora_id, request.lora_fingerprint)
                   if request.lora_name and self.pool.events is not None else None)
        for i in range(start, stop):
            if table[i] is not NULL_BLOCK:  # a block freed behind the window before its token was known
                self.pool.cache_block(table[i], hashes[i] + self.cache_tag, tokens[i * bs : (i + 1) * bs],
                                      hashes[i - 1] if i else None, adapter)
