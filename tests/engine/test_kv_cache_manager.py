"""KV cache manager: block tables, prefix hits, eviction order (num_blocks=8, block_size=4)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine_svc.kv.block_hash import hash_block_tokens
from engine_svc.kv.kv_cache_manager import KVCacheManager
from engine_svc.request import Request
from shared_runtime.contract import EngineCoreRequest, EngineSamplingParams

BS = 4


def req(rid: str, tokens: list[int], prompt_logprobs: int | None = None) -> Request:
    params = EngineSamplingParams(prompt_logprobs=prompt_logprobs)
    return Request(EngineCoreRequest(request_id=rid, prompt_token_ids=tokens, sampling_params=params), 1024)


@pytest.fixture
def kv() -> Iterator[KVCacheManager]:
    manager = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    yield manager
    assert manager.num_free_blocks == 8, "blocks leaked"
    assert all(b.ref_cnt == 0 for b in manager.pool.blocks)


def admit(kv: KVCacheManager, r: Request) -> list[int] | None:
    """What the scheduler does at admission: look up, allocate the rest of the known tokens, advance."""
    hits, num_hit = kv.get_computed_blocks(r)
    ids = kv.allocate_slots(r, r.num_tokens - num_hit, hits)
    if ids is not None:
        r.num_computed_tokens = r.num_tokens
    return ids


def test_allocation_order_and_block_table(kv: KVCacheManager) -> None:
    a, b = req("a", list(range(10))), req("b", list(range(100, 105)))
    assert admit(kv, a) == [0, 1, 2]
    assert admit(kv, b) == [3, 4]
    assert kv.get_block_ids("a") == [0, 1, 2] and kv.get_block_ids("a", 1) == [1, 2]
    assert kv.num_free_blocks == 3 and kv.usage == pytest.approx(5 / 8)
    # Decode: 10 -> 12 tokens stays in block 2; the 13th token needs a new block.
    for tok in (10, 11):
        a.append_output_token(tok)
        assert kv.allocate_slots(a, 1) == []
        a.num_computed_tokens += 1
    a.append_output_token(12)
    assert kv.allocate_slots(a, 1) == [5]
    assert kv.get_block_ids("a") == [0, 1, 2, 5]
    kv.free(a)
    kv.free(b)
    assert kv.get_block_ids("a") == []


def test_shared_prefix_ref_counts(kv: KVCacheManager) -> None:
    prefix = list(range(8))
    a, b = req("a", [*prefix, 50]), req("b", [*prefix, 60, 61])
    assert admit(kv, a) == [0, 1, 2]
    blocks, num_hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in blocks] == [0, 1] and num_hit == 8
    assert kv.allocate_slots(b, b.num_tokens - num_hit, blocks) == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    kv.free(a)
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 0, 1]
    assert kv.pool.free_queue.block_ids() == [4, 5, 6, 7, 2]
    kv.free(b)
    assert kv.pool.free_queue.block_ids() == [4, 5, 6, 7, 2, 3, 1, 0]


def test_free_is_reverse_order_and_freed_cached_blocks_are_evicted_lru(kv: KVCacheManager) -> None:
    a = req("a", list(range(12)))  # three full blocks, all cached
    assert admit(kv, a) == [0, 1, 2]
    kv.free(a)
    assert kv.pool.free_queue.block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    # Fresh tokens take 6 blocks from the head: the never-used ones, then a's tail block (evicted).
    d = req("d", list(range(100, 124)))
    assert admit(kv, d) == [3, 4, 5, 6, 7, 2]
    # a's prompt again: blocks 0 and 1 are still cached (hit capped at 11 tokens -> 2 blocks anyway).
    a2 = req("a2", list(range(12)))
    blocks, num_hit = kv.get_computed_blocks(a2)
    assert [blk.block_id for blk in blocks] == [0, 1] and num_hit == 8
    kv.free(d)
    # With a 13th token the 3-block hit is possible, but block 2 was evicted (reused by d).
    a3 = req("a3", list(range(13)))
    assert [blk.block_id for blk in kv.get_computed_blocks(a3)[0]] == [0, 1]


def test_older_freed_request_is_evicted_first(kv: KVCacheManager) -> None:
    a, b = req("a", list(range(8))), req("b", list(range(100, 108)))
    admit(kv, a)  # 0 1
    admit(kv, b)  # 2 3
    kv.free(a)
    kv.free(b)
    assert kv.pool.free_queue.block_ids() == [4, 5, 6, 7, 1, 0, 3, 2]
    c = req("c", list(range(200, 224)))  # 6 blocks: evicts a's tail block 1 and head block 0
    assert admit(kv, c) == [4, 5, 6, 7, 1, 0]
    assert kv.get_computed_blocks(req("a", [*range(8), 0]))[1] == 0
    assert kv.get_computed_blocks(req("b", [*range(100, 108), 0]))[1] == 8
    kv.free(c)


def test_hit_on_free_cached_block_takes_it_out_of_the_free_queue(kv: KVCacheManager) -> None:
    a = req("a", list(range(12)))
    admit(kv, a)
    kv.free(a)
    b = req("b", list(range(12)))
    blocks, num_hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in blocks] == [0, 1] and num_hit == 8
    assert all(blk.ref_cnt == 0 for blk in blocks)  # the lookup itself claims nothing
    assert kv.allocate_slots(b, 4, blocks) == [0, 1, 3]
    assert [blk.ref_cnt for blk in blocks] == [1, 1]
    assert kv.pool.free_queue.block_ids() == [4, 5, 6, 7, 2]
    kv.free(b)


@pytest.mark.parametrize(("num_tokens", "expected_hit"), [(8, 4), (9, 8), (12, 8), (4, 0), (5, 4)])
def test_full_hit_still_recomputes_the_last_token(
    kv: KVCacheManager, num_tokens: int, expected_hit: int
) -> None:
    a = req("a", list(range(12)))
    admit(kv, a)
    b = req("b", list(range(num_tokens)))
    assert kv.get_computed_blocks(b)[1] == expected_hit
    kv.free(a)


def test_forced_hash_collision_is_not_a_hit(kv: KVCacheManager) -> None:
    a = req("a", [1, 2, 3, 4, 5])
    admit(kv, a)
    b = req("b", [9, 9, 9, 9, 5])
    b.block_hashes = list(a.block_hashes)  # pretend b's first block hashed like a's
    assert kv.get_computed_blocks(b) == ([], 0)
    kv.free(a)


def test_failed_allocation_changes_nothing(kv: KVCacheManager) -> None:
    a = req("a", list(range(12)))
    admit(kv, a)
    kv.free(a)  # 0 1 2 cached and free
    # 33 tokens: the hit (0 1 2) is in the free queue, so 9 blocks would be needed from 8: refused.
    big = req("big", list(range(33)))
    blocks, num_hit = kv.get_computed_blocks(big)
    assert [blk.block_id for blk in blocks] == [0, 1, 2] and num_hit == 12
    before = kv.pool.free_queue.block_ids()
    assert kv.allocate_slots(big, 33 - 12, blocks) is None
    assert kv.pool.free_queue.block_ids() == before and kv.get_block_ids("big") == []
    assert all(blk.ref_cnt == 0 for blk in blocks)
    assert kv.prefix_cache_queries == 12  # only a's successful admission counted
    # 32 tokens fit exactly: 3 hits + 5 new blocks.
    fits = req("fits", list(range(32)))
    blocks, num_hit = kv.get_computed_blocks(fits)
    assert kv.allocate_slots(fits, 32 - num_hit, blocks) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert kv.num_free_blocks == 0
    kv.free(fits)


def test_blocks_filled_by_decode_are_cached(kv: KVCacheManager) -> None:
    a = req("a", [1, 2, 3])
    admit(kv, a)
    a.append_output_token(4)  # the 4th token fills block 0 once it is computed
    assert kv.pool.cached == {}
    assert kv.allocate_slots(a, 1) == []
    assert kv.pool.cached == {hash_block_tokens(None, [1, 2, 3, 4]): kv.pool.blocks[0]}
    a.num_computed_tokens += 1
    b = req("b", [1, 2, 3, 4, 5])
    assert kv.get_computed_blocks(b)[1] == 4
    kv.free(a)


def test_chunked_prefill_caches_each_block_once_filled(kv: KVCacheManager) -> None:
    a = req("a", list(range(10)))
    assert kv.allocate_slots(a, 6) == [0, 1]
    a.num_computed_tokens = 6
    assert list(kv.pool.cached.values()) == [kv.pool.blocks[0]]
    assert kv.allocate_slots(a, 4) == [2]
    assert list(kv.pool.cached.values()) == [kv.pool.blocks[0], kv.pool.blocks[1]]
    kv.free(a)


def test_free_uncaches_blocks_whose_step_never_ran(kv: KVCacheManager) -> None:
    a = req("a", list(range(16)))
    assert kv.allocate_slots(a, 4) == [0]
    a.num_computed_tokens = 4
    assert kv.allocate_slots(a, 12) == [1, 2, 3]  # caches blocks 1-3, then a is preempted before the step
    assert len(kv.pool.cached) == 4
    kv.free(a)  # num_computed_tokens is still 4: only block 0 holds computed K/V
    assert list(kv.pool.cached.values()) == [kv.pool.blocks[0]]
    assert kv.get_computed_blocks(req("b", list(range(16))))[1] == 4


def test_free_after_the_step_keeps_every_computed_block_cached(kv: KVCacheManager) -> None:
    a = req("a", list(range(9)))
    admit(kv, a)
    kv.free(a)
    assert [b.block_id for b in kv.pool.cached.values()] == [0, 1]


def test_prefix_counters_count_tokens_per_admission(kv: KVCacheManager) -> None:
    a, b = req("a", list(range(10))), req("b", list(range(10)))
    admit(kv, a)
    admit(kv, b)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (20, 8)
    kv.allocate_slots(b, 0)  # a running request's allocation is not a query
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (20, 8)
    kv.free(a)
    kv.free(b)


def test_prompt_logprobs_requests_skip_lookup_but_fill_the_cache(kv: KVCacheManager) -> None:
    a = req("a", list(range(10)), prompt_logprobs=1)
    admit(kv, a)
    b = req("b", list(range(10)), prompt_logprobs=0)
    assert kv.get_computed_blocks(b) == ([], 0)
    assert kv.get_computed_blocks(req("c", list(range(10))))[1] == 8
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)
    kv.free(a)


def test_prefix_caching_disabled() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a, b = req("a", list(range(10))), req("b", list(range(10)))
    assert admit(kv, a) == [0, 1, 2]
    assert kv.get_computed_blocks(b) == ([], 0)
    assert admit(kv, b) == [3, 4, 5]
    assert a.block_hashes == [] and kv.pool.cached == {}
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 8


def test_computed_blocks_only_at_admission(kv: KVCacheManager) -> None:
    a = req("a", list(range(9)))
    admit(kv, a)
    hits, _ = kv.get_computed_blocks(req("x", list(range(9))))
    with pytest.raises(ValueError):
        kv.allocate_slots(a, 1, hits)
    kv.free(a)
