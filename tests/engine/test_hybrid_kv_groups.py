"""Hybrid KV groups for any mix of attention types: unequal counts of full and sliding layers, several
windows (engine_svc/kv/groups.py: groups of equal size, one attention type each).

The manager alone: during decode each sliding group gives its blocks behind its window back to the pool
(the full group keeps them), every block comes back at the end, and a prefix hit is the longest every
group allows (the bound lowered group after group until none lowers it). Then tiny Qwen3 / Qwen2 models
whose `layer_types` / `max_window_layers` give 1 full + 3 sliding layers (groups of 1) and 2 full + 4
sliding (groups of 2), window 8, blocks of 4: float32 greedy tokens and logprobs equal transformers' with
chunked prefill, prefix caching (shared prefixes hit) and a pool small enough that freed blocks are
handed out again at once; preemption with async scheduling; pipeline stages; a draft model and an
EAGLE-3 head (their caches addressed through group 0's table). Two windows (transformers' configs give
one window for every sliding layer, so the engine's per-layer windows are set through `layer_windows`):
the same tokens and logprobs as one table keeping every block. Each run records the most real blocks any
running request held in each group.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

import engine_svc.model.registry as registry
import engine_svc.model.windows as windows_mod
from engine_svc.config import EngineConfig
from engine_svc.kv.hybrid_manager import HybridKVCacheManager
from engine_svc.kv.kv_cache_manager import NULL_BLOCK
from entrypoints import LLM, SamplingParams
from entrypoints.eagle3_head import make_eagle3_head
from tests.engine.test_hf_exact import (
    MAX_TOKENS,
    assert_greedy_matches_hf,
    assert_no_block_leaks,
    make_prompts,
)
from tests.engine.test_kv_cache_manager import req
from tests.engine.test_spec_eagle3 import record_drafts, reference_drafts

WINDOW, BS = 8, 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


def held(kv: HybridKVCacheManager, request_id: str) -> list[int]:
    """Real (not freed) blocks the request holds in each group."""
    return [sum(b is not NULL_BLOCK for b in g._tables.get(request_id, ())) for g in kv.groups]


# ---- the manager -------------------------------------------------------------------------------------------
def test_decode_gives_each_sliding_groups_blocks_back_behind_its_window() -> None:
    """Groups (None, 8, 8, 16): a full group, two sliding over 8 and one over 16; one request decoding
    token by token: after each step every sliding group holds only the blocks its window reads and the
    step's, the full group every block; all come back at the end."""
    kv = HybridKVCacheManager(200, BS, (None, 8, 8, 16), enable_prefix_caching=False)
    a = req("a", list(range(5, 17)))  # 12-token prompt
    assert kv.allocate_slots(a, 12) is not None
    a.num_computed_tokens = 12
    freed_during_decode = False
    for _ in range(40):
        a.append_output_token(7)
        before = kv.num_free_blocks
        assert kv.allocate_slots(a, 1) is not None
        q0 = a.num_computed_tokens
        blocks_of_positions = -(-(q0 + 1) // BS)
        full, *sliding = held(kv, "a")
        assert full == blocks_of_positions
        for w, n in zip((8, 8, 16), sliding):
            assert n == blocks_of_positions - max(0, q0 - w + 1) // BS  # exactly the window's and the step's
        freed_during_decode |= kv.num_free_blocks > before
        a.num_computed_tokens += 1
    assert freed_during_decode
    assert kv.num_free_blocks == 200 - sum(held(kv, "a"))
    kv.free(a)
    assert kv.num_free_blocks == 200


def test_prefix_hit_is_what_every_window_allows() -> None:
    """A 36-token prefix cached in groups (None, 4, 12): a hit of L blocks needs, for W 4, block L - 1
    and, for W 12, blocks L - 3 .. L - 1. W 12's block 7 evicted: W 12 lowers the bound to 7 blocks.
    W 4's block 6 evicted too: under that bound W 4, asked again, lowers it to 6, where every group holds
    what the hit needs (taking the least of the groups' first answers would claim W 4's missing block)."""
    kv = HybridKVCacheManager(200, BS, (None, 4, 12))
    prefix = list(range(5, 41))
    a = req("a", prefix)
    assert kv.allocate_slots(a, 36) is not None
    a.num_computed_tokens = 36
    full, w4, w12 = (list(g._tables["a"]) for g in kv.groups)
    kv.free(a)

    def lookup() -> tuple[list[list], int]:
        hits, num = kv.get_computed_blocks(req("b", [*prefix, 99, 98]))
        assert len(hits) == num // BS * 3
        return [hits[g::3] for g in range(3)], num

    assert lookup() == ([full, [NULL_BLOCK] * 8 + w4[8:], [NULL_BLOCK] * 6 + w12[6:]], 36)
    kv.pool.uncache(w12[7])
    assert lookup() == ([full[:7], [NULL_BLOCK] * 6 + w4[6:7], [NULL_BLOCK] * 4 + w12[4:7]], 28)
    kv.pool.uncache(w4[6])
    (hit_full, hit_w4, hit_w12), num = lookup()
    assert num == 24 and hit_full == full[:6]
    assert hit_w4 == [NULL_BLOCK] * 5 + w4[5:6] and hit_w12 == [NULL_BLOCK] * 3 + w12[3:6]
    b = req("b", [*prefix, 99, 98])
    hits, _ = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, 38 - 24, hits) is not None
    b.num_computed_tokens = 38
    kv.free(b)
    assert kv.num_free_blocks == 200


# ---- against transformers ----------------------------------------------------------------------------------
def with_windows(make_model, tmp_path_factory, arch: str, num_layers: int, **fields: Any) -> Path:
    """A tiny model of `num_layers` layers whose config sets the window and `fields` (no `layer_types`
    unless given: transformers and the engine then derive it from `max_window_layers`)."""
    src = make_model(arch, num_layers=num_layers)
    dst = tmp_path_factory.mktemp(f"{arch}-groups") / "model"
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.pop("layer_types", None)
    (dst / "config.json").write_text(json.dumps({**config, "sliding_window": WINDOW, "use_sliding_window": True,
                                                 **fields}))
    return dst


@pytest.fixture(scope="module")
def qwen3_1_3(make_model, tmp_path_factory) -> Path:
    """Layers sliding, full, sliding, sliding: groups (None, 8, 8, 8) of one layer each."""
    return with_windows(make_model, tmp_path_factory, "qwen3", 4,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"])


@pytest.fixture(scope="module")
def qwen2_2_4(make_model, tmp_path_factory) -> Path:
    """Layers 0-1 full, 2-5 sliding (`max_window_layers` 2, no `layer_types`): groups (None, 8, 8) of two."""
    return with_windows(make_model, tmp_path_factory, "qwen2", 6, max_window_layers=2)


GROUPS = {"qwen3_1_3": (None, WINDOW, WINDOW, WINDOW), "qwen2_2_4": (None, WINDOW, WINDOW)}


def run_groups(model_dir: Path, prompts: list[list[int]], groups: tuple[int | None, ...], rounds: int = 1,
               **engine_args: Any) -> tuple[LLM, list, list[int]]:
    """Generate greedily with these KV groups, the prompts in `rounds` calls one after another (later
    ones may hit earlier ones' blocks), recording after every step the most real blocks any running
    request held in each group; check no block leaked. (llm, outputs, most per group)."""
    llm = LLM(str(model_dir), dtype="float32", block_size=BS, **engine_args)
    assert llm.config.kv_group_windows == groups
    kv = llm.engine.scheduler.kv
    assert isinstance(kv, HybridKVCacheManager)
    most = [0] * len(groups)
    step = llm.engine.step

    def recording_step():  # type: ignore[no-untyped-def]
        out = step()
        for r in llm.engine.scheduler.running:
            most[:] = [max(m, n) for m, n in zip(most, held(kv, r.request_id))]
        return out

    llm.engine.step = recording_step  # type: ignore[method-assign]
    size = -(-len(prompts) // rounds)
    outs = [o for i in range(0, len(prompts), size) for o in llm.generate(prompts[i : i + size], GREEDY, use_tqdm=False)]
    assert_no_block_leaks(llm)
    return llm, outs, most


def window_bound(window: int, chunk: int) -> int:
    """The most blocks a sliding group may hold computing `chunk` tokens: its window's keys and the chunk."""
    return -(-(window - 1 + chunk) // BS) + 1


def shared_prefix_prompts(seed: int) -> list[list[int]]:
    """Six prompts of 22-45 tokens, the last three on the first's first 20 tokens (prefix hits)."""
    prompts = make_prompts(seed, 6, 500, lo=22, hi=40)
    return prompts[:3] + [prompts[0][:20] + tail for tail in make_prompts(seed + 1, 3, 500, lo=2, hi=25)]


@pytest.mark.parametrize(("model", "prefix_caching"), [
    ("qwen3_1_3", True),
    pytest.param("qwen2_2_4", True, marks=pytest.mark.slow),
    pytest.param("qwen3_1_3", False, marks=pytest.mark.slow),
])
def test_unequal_groups_match_transformers(request, model: str, prefix_caching: bool) -> None:
    """16-token steps (chunked prefill), 72 pool blocks: freed sliding blocks are handed out again while
    their old owners run. The sliding groups held at most their window's and step's blocks, the full
    group the longest request's whole context; the second round's prompts hit the first's prefix."""
    model_dir, groups = request.getfixturevalue(model), GROUPS[model]
    prompts = shared_prefix_prompts(31)
    _, outs, most = run_groups(model_dir, prompts, groups, rounds=2, max_num_batched_tokens=16,
                               num_gpu_blocks_override=72, enable_prefix_caching=prefix_caching)
    assert_greedy_matches_hf(model_dir, prompts, outs)
    full, *sliding = most
    assert max(sliding) <= window_bound(WINDOW, 16) < full
    assert full == max(-(-(len(p) + MAX_TOKENS - 2) // BS) for p in prompts)
    assert (sum(o.num_cached_tokens for o in outs) > 0) == prefix_caching


@pytest.mark.parametrize("model", ["qwen3_1_3", "qwen2_2_4"])
def test_the_pool_has_num_groups_times_the_blocks_in_the_same_memory(request, model: str) -> None:
    """A pool block holds one group's layers (no padding): the KV memory of 40 one-table blocks (every
    layer) gives 40 x num_groups pool blocks."""
    model_dir = request.getfixturevalue(model)
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    layer_block = 2 * config["num_key_value_heads"] * head_dim * 4 * BS  # K and V, float32
    memory = 40 * config["num_hidden_layers"] * layer_block
    for hybrid in (True, False):
        llm = LLM(str(model_dir), dtype="float32", block_size=BS, kv_cache_memory_bytes=memory,
                  disable_hybrid_kv_cache_manager=not hybrid)
        assert llm.engine.num_blocks == 40 * (len(GROUPS[model]) if hybrid else 1)


def test_preemption_and_async_scheduling_with_unequal_groups(qwen3_1_3: Path) -> None:
    """44 blocks (eleven blocks of positions over four groups) for five requests: preempted and resumed
    while freeing."""
    prompts = make_prompts(32, 5, 500, lo=14, hi=26)
    llm, outs, _ = run_groups(qwen3_1_3, prompts, GROUPS["qwen3_1_3"], num_gpu_blocks_override=44,
                              max_num_batched_tokens=16, async_scheduling=True)
    assert_greedy_matches_hf(qwen3_1_3, prompts, outs)
    assert llm.engine.get_stats().num_preemptions > 0


@pytest.mark.slow
def test_draft_model_with_unequal_groups(qwen3_1_3: Path) -> None:
    """The target as its own draft, over group 0's (full) table: every greedy draft is accepted only if
    the draft's K/V sits where it reads it; the tokens are transformers'."""
    prompts = make_prompts(33, 3, 500, lo=18, hi=30)
    spec = {"method": "draft_model", "model": str(qwen3_1_3), "num_speculative_tokens": 3}
    llm, outs, _ = run_groups(qwen3_1_3, prompts, GROUPS["qwen3_1_3"], speculative_config=spec,
                              max_num_batched_tokens=16, num_gpu_blocks_override=96)
    assert_greedy_matches_hf(qwen3_1_3, prompts, outs)
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens


@pytest.mark.slow
def test_eagle3_head_with_unequal_groups(qwen3_1_3: Path, tmp_path: Path) -> None:
    """An EAGLE-3 head on the hybrid target, its K/V over group 0's table: every draft equals the
    reference EAGLE-3 step on transformers' hidden states (test_spec_eagle3.py), through chunked prefill."""
    head = make_eagle3_head(qwen3_1_3, tmp_path / "head", aux_layer_ids=[1, 2, 3], seed=1, std=0.3)
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    llm = LLM(str(qwen3_1_3), dtype="float32", block_size=BS, max_num_batched_tokens=16, speculative_config=spec,
              enable_prefix_caching=False)
    assert llm.config.kv_group_windows == GROUPS["qwen3_1_3"]
    seen = record_drafts(llm)
    prompts = make_prompts(36, 3, 500, lo=18, hi=30)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    assert len(seen) >= 3 * 3
    assert all(drafts == reference_drafts(qwen3_1_3, head, tokens, len(drafts)) for tokens, drafts in seen)
    assert_no_block_leaks(llm)


@pytest.mark.slow
def test_pipeline_stages_with_unequal_groups(qwen2_2_4: Path) -> None:
    """PP=2 over gloo: stage 0 holds the full layers 0-1 and sliding 2, stage 1 sliding 3-5; each stage
    allocates only its layers' cache slots. Transformers' tokens, with chunked prefill and preemption."""
    prompts = make_prompts(34, 4, 500, lo=14, hi=30)
    llm = LLM(str(qwen2_2_4), dtype="float32", block_size=BS, device="cpu", pipeline_parallel_size=2,
              max_num_batched_tokens=16, num_gpu_blocks_override=40)
    try:
        assert llm.config.kv_group_windows == GROUPS["qwen2_2_4"]
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert_greedy_matches_hf(qwen2_2_4, prompts, outs)
        assert_no_block_leaks(llm)
        assert llm.engine.get_stats().num_preemptions > 0
    finally:
        llm.engine.shutdown()


# ---- two windows -------------------------------------------------------------------------------------------
TWO_WINDOWS = (None, 4, 12, 12)  # layer 0 full, layer 1 over 4 tokens, layers 2-3 over 12


@pytest.fixture
def two_windows(qwen3_1_3: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The 4-layer Qwen3 with the engine's per-layer windows set to TWO_WINDOWS (config and model)."""
    def windows(arch: str, config: Any, num_layers: int) -> tuple[int | None, ...]:
        assert num_layers == len(TWO_WINDOWS)
        return TWO_WINDOWS

    monkeypatch.setattr(windows_mod, "layer_windows", windows)
    monkeypatch.setattr(registry, "layer_windows", windows)
    return qwen3_1_3


def test_two_windows_match_one_table(two_windows: Path) -> None:
    """Groups (None, 4, 12, 12) against one table keeping every block (each layer applies its own window
    either way): the same tokens and logprobs, with chunked prefill and prefix hits; each sliding group
    held at most its own window's blocks."""
    prompts = shared_prefix_prompts(35)
    args = dict(max_num_batched_tokens=16, num_gpu_blocks_override=80)
    _, outs, most = run_groups(two_windows, prompts, (None, 4, 12, 12), rounds=2, **args)
    one_table = LLM(str(two_windows), dtype="float32", block_size=BS, disable_hybrid_kv_cache_manager=True, **args)
    assert one_table.config.kv_group_windows is None
    want = one_table.generate(prompts[:3], GREEDY, use_tqdm=False) + one_table.generate(prompts[3:], GREEDY,
                                                                                         use_tqdm=False)
    for got, expected in zip(outs, want):
        assert got.outputs[0].token_ids == expected.outputs[0].token_ids
        assert [e.logprob for e in got.outputs[0].logprobs] == pytest.approx(
            [e.logprob for e in expected.outputs[0].logprobs], abs=1e-4)
    assert sum(o.num_cached_tokens for o in outs) > 0
    assert most[1] <= window_bound(4, 16) < most[2] <= window_bound(12, 16) < most[0]


def test_a_draft_model_needs_a_full_group(two_windows: Path, monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    """Every layer sliding, over two windows: no full group whose table a draft could address, so the engine
    keeps one table (as vLLM turns its hybrid allocator off where it cannot run) and says why."""
    monkeypatch.setattr(sys.modules[__name__], "TWO_WINDOWS", (4, 4, 12, 12))
    assert EngineConfig.create(model=str(two_windows)).kv_group_windows == (4, 12)
    spec = {"method": "draft_model", "model": str(two_windows), "num_speculative_tokens": 2}
    with caplog.at_level(logging.INFO, logger="engine_svc.config"):
        assert EngineConfig.create(model=str(two_windows), speculative_config=spec).kv_group_windows is None
    assert "no layer attends in full" in caplog.text
