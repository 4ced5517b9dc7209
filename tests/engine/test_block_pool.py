"""Block pool, free queue and block hashes: exact block ids and eviction order."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine_svc.kv.block_hash import ROOT_HASH, extend_block_hashes, hash_block_tokens
from engine_svc.kv.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from engine_svc.request import Request
from shared_runtime.contract import EngineCoreRequest, EngineSamplingParams

REPO = Path(__file__).resolve().parents[2]


def _request(tokens: list[int]) -> Request:
    return Request(
        EngineCoreRequest(request_id="r", prompt_token_ids=tokens, sampling_params=EngineSamplingParams()),
        1024,
    )


# ---- free queue ---------------------------------------------------------------------------------------
def test_free_queue_popleft_append_and_remove_from_middle() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.block_ids() == [0, 1, 2, 3, 4] and len(q) == 5
    q.remove(blocks[2])
    assert q.block_ids() == [0, 1, 3, 4] and len(q) == 4
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    q.append(blocks[0])
    assert q.block_ids() == [1, 3, 4, 2, 0]
    q.remove(blocks[0])  # the tail
    q.remove(blocks[1])  # the head
    assert q.block_ids() == [3, 4, 2] and len(q) == 3
    for expected in (3, 4, 2):
        assert q.popleft().block_id == expected
    assert len(q) == 0
    with pytest.raises(IndexError):
        q.popleft()


# ---- pool ------------------------------------------------------------------------------------------------
def test_allocation_order_ref_counts_and_usage() -> None:
    pool = BlockPool(8)
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [0, 1, 2]
    assert [b.ref_cnt for b in got] == [1, 1, 1]
    assert pool.num_free_blocks == 5 and pool.usage == pytest.approx(3 / 8)
    assert [b.block_id for b in pool.get_new_blocks(2)] == [3, 4]
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)
    assert pool.num_free_blocks == 3  # a failed request takes nothing


def test_free_appends_to_tail_in_given_order_and_lru_reuse() -> None:
    pool = BlockPool(8)
    a = pool.get_new_blocks(3)  # 0 1 2
    b = pool.get_new_blocks(2)  # 3 4
    pool.free_blocks(reversed(a))
    pool.free_blocks(reversed(b))
    assert pool.free_queue.block_ids() == [5, 6, 7, 2, 1, 0, 4, 3]
    assert [blk.block_id for blk in pool.get_new_blocks(5)] == [5, 6, 7, 2, 1]
    assert pool.usage == pytest.approx(5 / 8)


def test_shared_block_is_freed_only_when_last_reference_drops() -> None:
    pool = BlockPool(4)
    (blk,) = pool.get_new_blocks(1)
    pool.touch([blk])
    assert blk.ref_cnt == 2
    pool.free_blocks([blk])
    assert blk.ref_cnt == 1 and pool.num_free_blocks == 3
    pool.free_blocks([blk])
    assert blk.ref_cnt == 0 and pool.free_queue.block_ids() == [1, 2, 3, 0]


def test_cached_free_block_is_found_touched_out_of_the_middle_then_evicted_on_reuse() -> None:
    pool = BlockPool(4)
    b0, b1 = pool.get_new_blocks(2)
    h0 = hash_block_tokens(None, [1, 2])
    h1 = hash_block_tokens(h0, [3, 4])
    assert pool.cache_block(b0, h0, [1, 2]) and pool.cache_block(b1, h1, [3, 4])
    pool.free_blocks([b1, b0])
    assert pool.free_queue.block_ids() == [2, 3, 1, 0]
    # Still findable while free; a hit takes it out of the middle of the queue.
    assert pool.get_cached_block(h1, [3, 4]) is b1
    pool.touch([b1])
    assert b1.ref_cnt == 1 and pool.free_queue.block_ids() == [2, 3, 0]
    # Reallocating a free cached block evicts its entry.
    assert [b.block_id for b in pool.get_new_blocks(3)] == [2, 3, 0]
    assert pool.get_cached_block(h0, [1, 2]) is None and b0.block_hash is None and b0.token_ids == ()
    assert pool.get_cached_block(h1, [3, 4]) is b1  # in use, still cached


def test_hash_hit_with_different_tokens_is_a_miss() -> None:
    pool = BlockPool(2)
    (blk,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_block(blk, h, [1, 2])
    assert pool.get_cached_block(h, [1, 2]) is blk
    assert pool.get_cached_block(h, [9, 9]) is None  # a (forced) collision is not a hit


def test_duplicate_hash_keeps_the_first_block() -> None:
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [1, 2])
    assert pool.cache_block(a, h, [1, 2])
    assert not pool.cache_block(b, h, [1, 2])
    assert not pool.cache_block(a, h, [1, 2])
    assert b.block_hash is None and pool.cached == {h: a}


# ---- hashes ----------------------------------------------------------------------------------------------
# Computed once with this module's canonical encoding; any change breaks cross-process agreement.
DIGEST_1234 = "5b31f617ab5640e356135bd8f2c3dba991c8e0effd09243fd689ec5058d02d18"
DIGEST_5678_AFTER_1234 = "e06c5742e6765b937d40009774482adef62e4821484f5183e3619ae8e32c8599"


def test_hash_digest_is_stable() -> None:
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h0.hex() == DIGEST_1234
    assert hash_block_tokens(h0, [5, 6, 7, 8]).hex() == DIGEST_5678_AFTER_1234
    assert hash_block_tokens(ROOT_HASH, [1, 2, 3, 4]) == h0  # None means the root


def test_hash_is_the_same_in_another_process() -> None:
    code = (
        "from engine_svc.kv.block_hash import hash_block_tokens as h;"
        "print(h(h(None, [1, 2, 3, 4]), [5, 6, 7, 8]).hex())"
    )
    env = {"PYTHONPATH": str(REPO), "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == DIGEST_5678_AFTER_1234


def test_hash_depends_on_parent_tokens_and_extra_keys() -> None:
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(h0, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(None, [1, 2, 3, 5]) != h0
    assert hash_block_tokens(None, [1, 2, 3, 4], ("lora", 7)) != h0
    assert hash_block_tokens(None, [1, 2, 3, 4], ("lora", 7)) == hash_block_tokens(
        None, [1, 2, 3, 4], ("lora", 7)
    )
    assert hash_block_tokens(None, [1 << 40]) != hash_block_tokens(None, [0, 256])  # fixed-width ids


def test_extend_block_hashes_covers_full_blocks_incrementally() -> None:
    req = _request([1, 2, 3, 4, 5, 6])
    extend_block_hashes(req, 4)
    assert req.block_hashes == [hash_block_tokens(None, [1, 2, 3, 4])]
    req.append_output_token(7)
    extend_block_hashes(req, 4)
    assert len(req.block_hashes) == 1  # 7 tokens: still one full block
    req.append_output_token(8)
    extend_block_hashes(req, 4)
    assert req.block_hashes == [
        hash_block_tokens(None, [1, 2, 3, 4]),
        hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 4]), [5, 6, 7, 8]),
    ]
