"""Sliding-window KV freeing in the KV cache manager (window 8, blocks of 4, 16 blocks).

A request computing from position q0 reads keys from q0 - 7 on only: every block wholly below that goes
back to the pool and its table entry becomes NULL_BLOCK. Checked: which blocks are held at each step
(exactly the window's), the free count through decodes, chunked prefill, preemption (free) and abort,
and prefix caching (a hit only on blocks whose cache entry, hence K/V, is intact; hits behind the new
request's window are not taken).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine_svc.kv.kv_cache_manager import NULL_BLOCK, KVCacheManager
from tests.engine.test_kv_cache_manager import admit, req

BS, WINDOW, NUM_BLOCKS = 4, 8, 16


@pytest.fixture
def kv() -> Iterator[KVCacheManager]:
    manager = KVCacheManager(NUM_BLOCKS, BS, enable_prefix_caching=True, sliding_window=WINDOW)
    yield manager
    assert manager.num_free_blocks == NUM_BLOCKS, "blocks leaked"
    assert all(b.ref_cnt == 0 for b in manager.pool.blocks)


def held(kv: KVCacheManager, rid: str) -> list[int]:
    """Table indices (block positions) whose entry is a real block."""
    return [i for i, b in enumerate(kv._tables[rid]) if b is not NULL_BLOCK]


def decode(kv: KVCacheManager, r, token: int) -> list[int] | None:
    """One decode step as the scheduler runs it: allocate for the last token, then advance."""
    ids = kv.allocate_slots(r, 1)
    assert ids is not None
    r.num_computed_tokens += 1
    r.append_output_token(token)
    return ids


def expected_held(num_computed: int, num_tokens: int) -> list[int]:
    """Blocks a request must hold to compute positions num_computed.. num_tokens - 1: from the block of
    key num_computed - WINDOW + 1 to the block of the last token."""
    first = max(0, num_computed - WINDOW + 1) // BS
    return list(range(first, -(-num_tokens // BS)))


def test_decodes_hold_only_the_window(kv: KVCacheManager) -> None:
    r = req("a", list(range(10)))
    assert admit(kv, r) == [0, 1, 2]
    r.append_output_token(500)
    for step in range(40):
        decode(kv, r, 600 + step)
        assert held(kv, "a") == expected_held(r.num_computed_tokens - 1, r.num_computed_tokens)
        assert len(held(kv, "a")) <= WINDOW // BS + 1
        assert kv.num_free_blocks == NUM_BLOCKS - len(held(kv, "a"))
        # the table stays indexed by position: one entry per block of positions
        assert len(kv.get_block_ids("a")) == -(-r.num_computed_tokens // BS)
    assert r.num_tokens == 51  # 13 blocks of context, with at most 3 held at any time
    kv.free(r)


def test_chunked_prefill_frees_behind_each_chunk(kv: KVCacheManager) -> None:
    """A 40-token prompt in chunks of 6 never holds more than the window plus the chunk."""
    r = req("a", list(range(40)))
    while r.num_computed_tokens < 40:
        n = min(6, 40 - r.num_computed_tokens)
        assert kv.allocate_slots(r, n) is not None
        assert held(kv, "a") == expected_held(r.num_computed_tokens, r.num_computed_tokens + n)
        r.num_computed_tokens += n
    assert len(held(kv, "a")) <= (WINDOW + 6) // BS + 1
    kv.free(r)


def test_more_long_requests_fit_than_without_a_window() -> None:
    """16 blocks hold one 60-token context in full, but five under a window of 8. Six requests decode in
    lockstep to 60 tokens; one that finds no block is dropped (its blocks freed), the rest go on."""
    def run(window: int | None) -> int:
        kv = KVCacheManager(NUM_BLOCKS, BS, enable_prefix_caching=False, sliding_window=window)
        reqs = [req(f"r{i}", [i] * 4) for i in range(6)]
        running = []
        for r in reqs:
            if admit(kv, r) is not None:
                running.append(r)
        for step in range(56):  # every admitted request decodes to 60 tokens; stop admitting on shortage
            for r in list(running):
                if kv.allocate_slots(r, 1) is None:
                    kv.free(r)
                    running.remove(r)
                    continue
                r.num_computed_tokens += 1
                r.append_output_token(step)
        survivors = len(running)
        for r in running:
            kv.free(r)
        assert kv.num_free_blocks == NUM_BLOCKS
        return survivors

    assert run(None) == 1  # a 60-token context needs 15 of the 16 blocks
    assert run(WINDOW) == 5  # 2 or 3 blocks each (3 while the window spans three blocks)


def test_free_returns_every_block_after_a_preemption_mid_prefill(kv: KVCacheManager) -> None:
    r = req("a", list(range(30)))
    assert kv.allocate_slots(r, 16) is not None
    r.num_computed_tokens = 16
    assert kv.allocate_slots(r, 8) is not None  # frees blocks 0 and 1 (keys 9.. are needed)
    assert held(kv, "a") == [2, 3, 4, 5]
    kv.free(r)  # preempted in the step that allocated blocks 4-5: their entries go, the rest stay cached
    r.num_computed_tokens = 0
    assert kv.num_free_blocks == NUM_BLOCKS
    # resumed from scratch: blocks 0..3 are cached (0-1 freed by the window but never handed out since);
    # a hit of 16 tokens needs only blocks 2-3 (the keys position 16 reads): 0-1 come back as placeholders
    hits, num_hit = kv.get_computed_blocks(r)
    assert num_hit == 16 and hits[:2] == [NULL_BLOCK, NULL_BLOCK]
    assert kv.allocate_slots(r, 8, hits) is not None
    assert kv._tables["a"][:2] == [NULL_BLOCK, NULL_BLOCK]
    assert [b.ref_cnt for b in hits[2:]] == [1, 1]
    kv.free(r)


def test_a_hit_never_takes_a_block_handed_out_again(kv: KVCacheManager) -> None:
    """Request a's early blocks go back to the pool behind its window; once another request takes them
    (and writes other K/V there), a lookup of a's prompt takes none of them: it hits on the window's
    blocks a still holds, the earlier entries are placeholders."""
    prompt = list(range(24))
    a = req("a", prompt)
    for _ in range(6):  # chunks of 4: blocks 0 .. 2 freed behind the window as a advances
        assert kv.allocate_slots(a, 4) is not None
        a.num_computed_tokens += 4
    assert held(kv, "a") == [3, 4, 5]
    freed = [kv.pool.cached[h].block_id for h in a.block_hashes[:3]]
    assert all(kv.pool.blocks[i].ref_cnt == 0 for i in freed)
    probe = req("p", [*prompt, 99])
    hits, num_hit = kv.get_computed_blocks(probe)
    assert num_hit == 24 and hits[:4] == [NULL_BLOCK] * 4  # only blocks 4-5 are read from position 24
    # another request takes every free block: the freed ones are evicted (uncached) as it takes them
    b = req("b", [7] * (4 * kv.num_free_blocks))
    assert admit(kv, b) is not None
    assert all(kv.pool.blocks[i].block_hash not in a.block_hashes for i in freed)
    hits, num_hit = kv.get_computed_blocks(probe)
    assert num_hit == 24 and hits[4:] == kv._tables["a"][4:6]
    assert not {h.block_id for h in hits if h is not NULL_BLOCK} & set(kv.get_block_ids("b"))
    kv.free(a)
    kv.free(b)


def test_a_window_hit_needs_the_window_blocks_or_the_whole_chain(kv: KVCacheManager) -> None:
    """Cached blocks 0, 1 and 3 of a 6-block prompt, window 8 (position 4k reads blocks k-2 and k-1):
    block 3 alone ends no hit, blocks 0-1 do, so the hit is 8 tokens, without placeholders."""
    prompt = list(range(24))
    a = req("a", prompt)
    admit(kv, a)  # caches blocks 0 .. 5
    kv.free(a)
    for i in (2, 4, 5):
        kv.pool.uncache(kv.pool.cached[a.block_hashes[i]])
    hits, num_hit = kv.get_computed_blocks(req("p", [*prompt, 99]))
    assert num_hit == 8 and NULL_BLOCK not in hits


def test_abort_while_waiting_for_a_token_frees_everything(kv: KVCacheManager) -> None:
    """A decode past several windows, then freed (abort): nothing stays referenced, NULL_BLOCK is never
    put in the pool or the cache."""
    r = req("a", list(range(5)))
    admit(kv, r)
    r.append_output_token(1)
    for step in range(25):
        decode(kv, r, 100 + step)
    kv.free(r)
    assert NULL_BLOCK.ref_cnt == 0 and NULL_BLOCK.block_hash is None
    assert all(block is not NULL_BLOCK for block in kv.pool.blocks)
