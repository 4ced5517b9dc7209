"""Cache-aware routing (frontend_svc/engines/router.py) over engines whose cache views are given exactly.

SGLang's / SMG's cache_aware semantics: the longest cached prefix wins when it covers more than
`cache_threshold` of the prompt (ties: least loaded) and its engine is not overloaded (more than both
balance thresholds above the least-loaded engine); otherwise the least-loaded engine (ties: the longer
cached prefix, then the one caching least). The absolute threshold defaults to a quarter of the engine's
--max-num-seqs.
The prompt is hashed with the engine's own function, per block size, and only as far as some engine
still matches.
"""

from __future__ import annotations

import pytest

from frontend_svc.config import ConfigError, FrontendConfig, default_routing
from frontend_svc.engines.router import CacheAwareSettings, Router, cached_prefix_tokens
from shared_runtime import kv_hash
from shared_runtime.kv_hash import iter_block_hashes

BS = 4
PROMPT = list(range(100, 124))  # six full blocks


class Engine:
    def __init__(self, address: str, load: int = 0, cached: set[bytes] | None = None, block_size: int = BS,
                 max_num_seqs: int = 256) -> None:
        self.address, self.load, self.block_size = address, load, block_size
        self.kv_index: set[bytes] = cached or set()
        self.max_num_seqs = max_num_seqs


def holding(address: str, blocks: int, load: int = 0, prompt: list[int] = PROMPT, max_num_seqs: int = 256) -> Engine:
    """An engine caching the first `blocks` blocks of `prompt`."""
    return Engine(address, load, set(list(iter_block_hashes(prompt, BS))[:blocks]), max_num_seqs=max_num_seqs)


def test_the_longest_cached_prefix_wins() -> None:
    router = Router("cache-aware")
    engines = [holding("a", 2), holding("b", 5), holding("c", 3)]
    assert [router.choose(engines, PROMPT).address for _ in range(4)] == ["b"] * 4
    assert cached_prefix_tokens(engines, PROMPT) == [8, 20, 12]


def test_a_prefix_counts_only_from_the_first_block() -> None:
    """The engine's lookup stops at its first miss, and so does the view: later blocks alone count nothing."""
    hashes = list(iter_block_hashes(PROMPT, BS))
    gapped = Engine("gapped", cached=set(hashes[1:]))  # every block but the first
    assert cached_prefix_tokens([gapped, holding("one", 1)], PROMPT) == [0, 4]


def test_equal_matches_go_to_the_least_loaded_and_rotate_when_loads_tie() -> None:
    router = Router("cache-aware")
    engines = [holding("a", 4, load=3), holding("b", 4, load=1), holding("c", 4, load=1), holding("d", 1)]
    assert {router.choose(engines, PROMPT).address for _ in range(6)} == {"b", "c"}


def test_below_the_cache_threshold_the_least_loaded_engine_gets_it() -> None:
    router = Router("cache-aware", cache_aware=CacheAwareSettings(cache_threshold=0.5))
    other = list(range(500, 540))
    busy_match = holding("match", 3, load=2)  # 12 of 24 tokens = 0.5: not above the threshold
    full = Engine("full", load=0, cached=set(iter_block_hashes(other, BS)))
    empty = Engine("empty", load=0)
    assert router.choose([busy_match, full, empty], PROMPT).address == "empty"  # idle, and caching least
    idle_match = holding("idle-match", 1)
    assert router.choose([busy_match, full, empty, idle_match], PROMPT).address == "idle-match"  # longer prefix
    busy_match.kv_index.update(list(iter_block_hashes(PROMPT, BS))[3:4])  # now 16 of 24 > 0.5
    assert router.choose([busy_match, full, empty], PROMPT).address == "match"


def test_an_overloaded_engine_loses_the_request_to_the_least_loaded() -> None:
    router = Router("cache-aware", cache_aware=CacheAwareSettings(balance_abs_threshold=4, balance_rel_threshold=2.0))
    owner, idle = holding("owner", 6, load=12), Engine("idle", load=7)
    assert router.choose([owner, idle], PROMPT).address == "owner"  # 12 - 7 > 4 but 12 <= 2 x 7: balanced
    idle.load = 3
    assert router.choose([owner, idle], PROMPT).address == "idle"  # 12 - 3 > 4 and 12 > 2 x 3
    owner.load = 7
    assert router.choose([owner, idle], PROMPT).address == "owner"  # 7 > 2 x 3 but 7 - 3 is not above 4


def test_only_the_chosen_engines_load_matters_not_an_imbalance_elsewhere() -> None:
    router = Router("cache-aware", cache_aware=CacheAwareSettings(balance_abs_threshold=4))
    owner, hot, idle = holding("owner", 6, load=2), Engine("hot", load=50), Engine("idle", load=0)
    assert router.choose([owner, hot, idle], PROMPT).address == "owner"


def test_the_absolute_threshold_defaults_to_a_quarter_of_the_engines_batch() -> None:
    router = Router("cache-aware")
    owner, idle = holding("owner", 6, load=3, max_num_seqs=8), Engine("idle", load=0, max_num_seqs=8)
    assert router.choose([owner, idle], PROMPT).address == "idle"  # 3 - 0 > 8 / 4
    owner.load = 2
    assert router.choose([owner, idle], PROMPT).address == "owner"
    big_owner = holding("big", 6, load=60, max_num_seqs=256)
    assert router.choose([big_owner, idle], PROMPT).address == "big"  # 60 is not above 256 / 4


def test_engines_with_another_block_size_are_matched_with_their_own_hashes() -> None:
    big = Engine("big", cached=set(list(iter_block_hashes(PROMPT, 8))[:2]), block_size=8)
    small = holding("small", 3)
    assert cached_prefix_tokens([big, small], PROMPT) == [16, 12]
    assert Router("cache-aware").choose([big, small], PROMPT).address == "big"


def test_hashing_stops_at_the_first_block_no_engine_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    long_prompt = list(range(4000))  # 1000 blocks
    engines = [holding("a", 2, prompt=long_prompt), Engine("b")]
    calls = []
    real = kv_hash.hash_block_tokens
    monkeypatch.setattr(kv_hash, "hash_block_tokens", lambda *a: calls.append(1) or real(*a))
    assert Router("cache-aware").choose(engines, long_prompt).address == "a"  # idle both: the longer prefix
    assert len(calls) == 3


def test_the_cli_default_is_cache_aware_when_there_can_be_several_engines() -> None:
    assert default_routing(("h:1",)) == "least-load"
    assert default_routing(("h:1", "h:2")) == "cache-aware"
    assert default_routing(("dns:///engines.ns.svc:50051",)) == "cache-aware"


@pytest.mark.parametrize(("settings", "flag"), [
    (CacheAwareSettings(cache_threshold=1.5), "--cache-threshold"),
    (CacheAwareSettings(balance_abs_threshold=-1), "--balance-abs-threshold"),
    (CacheAwareSettings(balance_rel_threshold=0.5), "--balance-rel-threshold"),
])
def test_thresholds_out_of_range_are_refused_naming_the_flag(settings: CacheAwareSettings, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        FrontendConfig(model=None, routing="cache-aware", cache_aware=settings)
