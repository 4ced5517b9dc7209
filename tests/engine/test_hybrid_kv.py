"""Hybrid models (sliding and full attention layers) with one KV block table per attention type.

The manager alone: interleaved tables, the sliding group freeing behind its window while the full group
keeps every block, all-or-nothing allocation over the shared pool, every group's hits out of the free
queue before any new block is taken, KV events for the full group only, every block back on free. Then tiny
gpt-oss (sliding / full layers in turn, window 8) and Qwen3 (`layer_types` mixing both), blocks of 4:
float32 greedy tokens and logprobs equal transformers' with chunked prefill, async scheduling and
preemption under a pool small enough that freed blocks are handed out again at once (a layer reading
another group's table, or a freed block read again, would change the tokens), n-gram speculative
decoding, and prefix hits longer
than the window (the sliding group's early blocks evicted) or cut short by the full group. Each run
checks that the sliding group really held at most its window's and its step's blocks and that every
block is back in the pool. The capacity test runs long requests in the same KV memory with and without
the groups.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine_svc.config import EngineConfig
from engine_svc.kv.block_hash import hash_block_tokens
from engine_svc.kv.events import KVEventLog, StoredBlock
from engine_svc.kv.groups import hybrid_groups
from engine_svc.kv.hybrid_manager import HybridKVCacheManager
from engine_svc.kv.kv_cache_manager import NULL_BLOCK
from engine_svc.kv_transfer.config import KVTransferConfig
from entrypoints import LLM, SamplingParams
from tests.engine.test_hf_exact import (
    MAX_TOKENS,
    assert_greedy_matches_hf,
    assert_no_block_leaks,
    make_prompts,
)
from tests.engine.test_kv_cache_manager import req

WINDOW, BS = 8, 4
HASH_LEN = len(hash_block_tokens(None, ()))  # the sliding group's cache keys carry one more byte


# ---- the grouping and the manager --------------------------------------------------------------------------
def test_groups_pair_the_layers_of_each_type() -> None:
    groups = hybrid_groups((8, None, 8, None))
    assert groups is not None and groups.windows == (None, 8)
    assert groups.layer_group == (1, 0, 1, 0) and groups.layer_slot == (0, 0, 1, 1)
    assert groups.layers_per_group == 2
    for one_table in (None, (8, 8), (None, None)):
        assert hybrid_groups(one_table) is None


def test_unequal_counts_and_several_windows_split_into_groups_of_equal_size() -> None:
    """Group size: the counts' greatest common divisor; full groups first, then windows smallest first."""
    two_ten = hybrid_groups((None, None, *(8,) * 10))  # 2 full + 10 sliding: groups of 2
    assert two_ten is not None and two_ten.windows == (None, 8, 8, 8, 8, 8)
    assert two_ten.layer_group == (0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5) and two_ten.layer_slot == (0, 1) * 6
    one_three = hybrid_groups((8, None, 8, 8))  # 1 full + 3 sliding: groups of 1
    assert one_three is not None and one_three.windows == (None, 8, 8, 8)
    assert one_three.layer_group == (1, 0, 2, 3) and one_three.layer_slot == (0,) * 4
    mixed = hybrid_groups((16, None, 4, 16, None, 4, 16, 16))  # 2 full, 2 of W 4, 4 of W 16: groups of 2
    assert mixed is not None and mixed.windows == (None, 4, 16, 16) and mixed.layers_per_group == 2
    assert mixed.layer_group == (2, 0, 1, 2, 0, 1, 3, 3) and mixed.layer_slot == (0, 0, 0, 1, 1, 1, 0, 1)
    no_full = hybrid_groups((4, 16, 16, 4))
    assert no_full is not None and no_full.windows == (4, 16) and no_full.layer_slot == (0, 0, 1, 1)


def test_sliding_group_frees_behind_its_window_while_the_full_group_keeps_all() -> None:
    kv = HybridKVCacheManager(40, BS, (None, WINDOW), enable_prefix_caching=False)
    a = req("a", list(range(5, 29)))  # 24 tokens: 6 blocks of positions
    ids = kv.allocate_slots(a, 16)
    assert ids is not None and len(ids) == 8 and kv.num_free_blocks == 32
    full, sliding = (g._tables["a"] for g in kv.groups)
    assert ids == [b.block_id for pair in zip(full, sliding) for b in pair]
    assert kv.get_block_ids("a", 3) == ids[3:] and kv.get_block_ids("a", 8) == []
    a.num_computed_tokens = 16  # next chunk from q0 = 16 reads keys 9.. on: blocks 0 and 1 go back
    more = kv.allocate_slots(a, 8)
    assert more is not None and len(more) == 4
    full, sliding = (g._tables["a"] for g in kv.groups)
    assert len(full) == len(sliding) == 6 and all(b is not NULL_BLOCK and b.ref_cnt == 1 for b in full)
    assert [b is NULL_BLOCK for b in sliding] == [True, True, False, False, False, False]
    assert kv.num_free_blocks == 40 - 6 - 4
    kv.free(a)
    assert kv.num_free_blocks == 40


def test_allocation_is_all_or_nothing_over_the_shared_pool() -> None:
    kv = HybridKVCacheManager(7, BS, (None, WINDOW), enable_prefix_caching=False)
    a = req("a", list(range(5, 21)))
    assert kv.allocate_slots(a, 16) is None and kv.num_free_blocks == 7  # 4 blocks per group = 8 > 7
    assert kv.allocate_slots(a, 12) is not None and kv.num_free_blocks == 1
    kv.free(a)
    assert kv.num_free_blocks == 7


def test_hits_of_every_group_leave_the_free_queue_before_any_new_block_is_taken() -> None:
    """The sliding group's hits at the head of the free queue: the full group's new block must not be
    one of them (it would evict it and both tables would share it)."""
    kv = HybridKVCacheManager(10, BS, (None, WINDOW))
    a, x = req("a", list(range(5, 17))), req("x", list(range(100, 108)))
    assert kv.allocate_slots(a, 12) is not None and kv.allocate_slots(x, 8) is not None
    a.num_computed_tokens, x.num_computed_tokens = 12, 8
    kv.groups[1].free(a)  # the free queue: a's sliding blocks, its full blocks, x's
    kv.groups[0].free(a)
    kv.free(x)
    b = req("b", [*range(5, 17), 200, 201, 202, 203])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 12
    assert kv.allocate_slots(b, 4, hits) is not None
    full, sliding = (g._tables["b"] for g in kv.groups)
    assert not {id(blk) for blk in full} & {id(blk) for blk in sliding if blk is not NULL_BLOCK}
    assert all(blk.ref_cnt == 1 for blk in full + sliding if blk is not NULL_BLOCK)


def test_kv_events_report_the_full_groups_blocks_only() -> None:
    """Cache-aware routers hear of the full group's blocks (whole prefixes, plain hashes); the sliding
    group's tagged entries stay out of the log, stored and evicted alike."""
    log = KVEventLog()
    kv = HybridKVCacheManager(4, BS, (None, WINDOW), events=log)
    a = req("a", list(range(5, 13)))
    assert kv.allocate_slots(a, 8) is not None
    a.num_computed_tokens = 8
    kv.hash_blocks(a)
    assert [e.block_hash for e in log.take() if isinstance(e, StoredBlock)] == a.block_hashes
    assert len(kv.pool.cached) == 4  # both groups' blocks are cached
    kv.free(a)
    b = req("b", list(range(50, 58)))
    assert kv.allocate_slots(b, 8) is not None  # evicts all four of a's blocks
    assert [e for e in log.take() if not isinstance(e, StoredBlock)] == a.block_hashes[::-1]
    kv.free(b)


# ---- against transformers ----------------------------------------------------------------------------------
def with_config(make_model, tmp_path_factory, arch: str, **fields) -> Path:
    src = make_model(arch)
    dst = tmp_path_factory.mktemp(f"{arch}-hybrid") / "model"
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **fields}))
    return dst


@pytest.fixture(scope="module")
def gpt_oss(make_model) -> Path:
    return make_model("gpt_oss")  # layers sliding, full; window 8


@pytest.fixture(scope="module")
def qwen3(make_model, tmp_path_factory) -> Path:
    return with_config(make_model, tmp_path_factory, "qwen3", sliding_window=WINDOW, use_sliding_window=True,
                       layer_types=["full_attention", "sliding_attention"])


def run_hybrid(model_dir: Path, prompts: list[list[int]], **engine_args) -> tuple[LLM, list[int]]:
    """Generate greedily with hybrid KV groups, recording after every step the most real blocks any
    running request holds in each group; compare with transformers; check no block leaked."""
    llm = LLM(str(model_dir), dtype="float32", block_size=BS, **engine_args)
    assert llm.config.kv_group_windows == (None, WINDOW)
    kv = llm.engine.scheduler.kv
    assert isinstance(kv, HybridKVCacheManager)
    most = [0, 0]
    step = llm.engine.step

    def recording_step():
        out = step()
        for r in llm.engine.scheduler.running:
            for g, group in enumerate(kv.groups):
                most[g] = max(most[g], sum(b is not NULL_BLOCK for b in group._tables.get(r.request_id, ())))
        return out

    llm.engine.step = recording_step  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    assert_greedy_matches_hf(model_dir, prompts, llm.generate(prompts, params, use_tqdm=False))
    assert_no_block_leaks(llm)
    return llm, most


def chunk_bound(chunk: int) -> int:
    """The most blocks the sliding group may hold computing `chunk` tokens: its window's keys and the chunk."""
    return -(-(WINDOW - 1 + chunk) // BS) + 1


@pytest.mark.parametrize(("arch", "prefix_caching"), [("gpt_oss", True), ("qwen3", False)])
def test_hybrid_models_match_transformers_with_chunked_prefill(request, arch: str, prefix_caching: bool) -> None:
    """A pool of 64 blocks: freed sliding blocks are handed out again while their old owner runs."""
    model_dir = request.getfixturevalue(arch)
    prompts = make_prompts(21, 5, 500, lo=20, hi=40)
    _, (full, sliding) = run_hybrid(model_dir, prompts, max_num_batched_tokens=16, num_gpu_blocks_override=64,
                                    enable_prefix_caching=prefix_caching)
    # the full group held the longest request's whole context (recorded up to its last step but one)
    assert sliding <= chunk_bound(16) < full == max(-(-(len(p) + MAX_TOKENS - 2) // BS) for p in prompts)


def test_async_scheduling_and_preemption_with_groups(gpt_oss: Path) -> None:
    """Twenty blocks (ten per group's worth) for five requests: preempted and resumed while freeing."""
    prompts = make_prompts(22, 5, 500, lo=10, hi=24)
    llm, _ = run_hybrid(gpt_oss, prompts, num_gpu_blocks_override=20, max_num_batched_tokens=16,
                        async_scheduling=True)
    assert llm.engine.get_stats().num_preemptions > 0


def test_speculative_decoding_with_groups_matches_transformers(qwen3: Path) -> None:
    """n-gram drafts verified as multi-token steps (rejected drafts lower the computed tokens) over the
    groups' tables, repetitive prompts so the proposer drafts: still transformers' tokens and logprobs."""
    prompts = [(p * 6)[:24 + 3 * i] for i, p in enumerate(make_prompts(24, 3, 500, lo=3, hi=5))]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    llm, _ = run_hybrid(qwen3, prompts, speculative_config=spec, num_gpu_blocks_override=48)
    assert llm.engine.scheduler.spec_stats.num_draft_tokens > 0


def test_groups_are_used_only_where_they_fit(gpt_oss: Path) -> None:
    """--disable-hybrid-kv-cache-manager keeps one table for every layer; so does P/D (a KV connector moves
    one table per request), as vLLM turns its hybrid allocator off with a connector."""
    assert EngineConfig.create(model=str(gpt_oss)).kv_group_windows == (None, WINDOW)
    assert EngineConfig.create(model=str(gpt_oss), disable_hybrid_kv_cache_manager=True).kv_group_windows is None
    producer = KVTransferConfig(kv_role="kv_producer")
    assert EngineConfig.create(model=str(gpt_oss), kv_transfer_config=producer).kv_group_windows is None


def _prefix_run(gpt_oss: Path, evict) -> list[int]:
    """A shared 33-token prefix run once; `evict(pool, early)` uncaches some of its blocks (as the pool
    would when it hands them out); then two prompts on it: tokens equal transformers'. Their hits."""
    shared = make_prompts(13, 1, 500, lo=33, hi=33)[0]
    prompts = [shared + tail for tail in make_prompts(14, 3, 500, lo=2, hi=9)]
    llm = LLM(str(gpt_oss), dtype="float32", block_size=BS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    llm.generate(prompts[:1], params, use_tqdm=False)
    pool = llm.engine.scheduler.kv.pool
    blocks = {tuple(shared[i * BS : (i + 1) * BS]): i for i in range(8)}
    for block in pool.blocks:
        if block.block_hash is not None and block.token_ids in blocks:
            assert block.ref_cnt == 0
            if evict(blocks[block.token_ids], sliding=len(block.block_hash) == HASH_LEN + 1):
                pool.uncache(block)
    rest = llm.generate(prompts[1:], params, use_tqdm=False)
    assert_greedy_matches_hf(gpt_oss, prompts[1:], rest)
    assert_no_block_leaks(llm)
    return [out.num_cached_tokens for out in rest]


def test_prefix_hit_longer_than_the_window(gpt_oss: Path) -> None:
    """The sliding group's blocks 0-5 evicted: position 32's window reads blocks 6 and 7 only, so the
    hit is still 32 tokens (the full group holds all eight blocks), four times the window."""
    assert _prefix_run(gpt_oss, lambda i, sliding: sliding and i < 6) == [32, 32]


def test_prefix_hit_is_cut_to_what_every_group_holds(gpt_oss: Path) -> None:
    """The full group's block 3 evicted: the hit stops at 12 tokens, where the sliding group's blocks 1
    and 2 are cached; the sliding group's block 7 evicted: 28 tokens (blocks 5 and 6). The second prompt,
    admitted in the same step, hits the blocks the first one cached again at its allocation."""
    assert _prefix_run(gpt_oss, lambda i, sliding: not sliding and i == 3) == [12, 32]
    assert _prefix_run(gpt_oss, lambda i, sliding: sliding and i == 7) == [28, 32]


def test_capacity_more_long_requests_in_the_same_memory(gpt_oss: Path) -> None:
    """The same KV memory with and without the groups: long requests run more at once with them (the
    sliding layers hold about a window's blocks instead of the whole context's), with the same tokens
    and logprobs (one table is exact against transformers above and in test_hf_exact.py)."""
    prompts = make_prompts(23, 8, 500, lo=56, hi=60)
    peak, outputs = {}, {}
    for hybrid in (True, False):
        llm = LLM(str(gpt_oss), dtype="float32", block_size=BS, enable_prefix_caching=False,
                  kv_cache_memory_bytes=2 * 2 * 2 * 16 * 4 * BS * 40,  # 40 one-table blocks of both layers
                  max_num_batched_tokens=16, disable_hybrid_kv_cache_manager=not hybrid)
        assert llm.engine.num_blocks == (80 if hybrid else 40)
        running: list[int] = []
        step = llm.engine.step

        def recording_step(step=step, llm=llm, running=running):
            running.append(llm.engine.scheduler.num_running)
            return step()

        llm.engine.step = recording_step  # type: ignore[method-assign]
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
        outs = llm.generate(prompts, params, use_tqdm=False)
        outputs[hybrid] = [(o.outputs[0].token_ids, [e.logprob for e in o.outputs[0].logprobs]) for o in outs]
        assert_no_block_leaks(llm)
        peak[hybrid] = max(running)
    assert peak[True] > peak[False]
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(outputs[True], outputs[False]):
        assert tokens == want_tokens and logprobs == pytest.approx(want_logprobs, abs=1e-4)
