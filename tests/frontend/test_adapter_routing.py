"""Routing requests on LoRA adapters (frontend_svc/engines/router.py) over engines whose cache views and
adapters are given exactly.

An adapter request goes only to engines serving the adapter; its prompt is hashed under the adapter's
fingerprint as each engine announced it (shared_runtime.kv_hash.lora_extra_keys, the engine's function),
so only blocks cached under that adapter's weights count; the adapter being active on an engine (its
last stats) acts as affinity when no engine caches enough, and breaks ties between equal cache hits.
Base-model routing is unchanged (tests/frontend/test_cache_aware_routing.py).
"""

from __future__ import annotations

from tandem.engine.v1 import engine_core_pb2 as epb

from frontend_svc.engines.client import EngineConnection
from frontend_svc.engines.router import CacheAwareSettings, Router, cached_prefix_tokens
from shared_runtime.kv_hash import iter_block_hashes, lora_extra_keys

BS = 4
PROMPT = list(range(200, 224))  # six full blocks
FP = {"x": "11" * 32, "y": "22" * 32}


class Engine:
    def __init__(self, address: str, load: int = 0, adapters: dict[str, str] | None = None,
                 active: frozenset[str] = frozenset(), max_num_seqs: int = 256) -> None:
        self.address, self.load, self.block_size, self.max_num_seqs = address, load, BS, max_num_seqs
        self.kv_index: set[bytes] = set()
        self.adapters = dict(FP) if adapters is None else adapters  # name -> fingerprint
        self.active_adapters = active

    def lora_fingerprint(self, name: str) -> str | None:
        return self.adapters.get(name)

    def cache(self, blocks: int, lora: str = "", fingerprint: str | None = None) -> Engine:
        """Cache the first `blocks` blocks of PROMPT as computed under `lora` (its fingerprint: FP's)."""
        keys = lora_extra_keys(fingerprint or FP[lora]) if lora else ()
        self.kv_index.update(list(iter_block_hashes(PROMPT, BS, keys))[:blocks])
        return self


def test_a_prompt_cached_under_one_adapter_is_a_hit_for_that_adapter_only() -> None:
    router = Router("cache-aware")
    under_x, under_base, under_y = Engine("x").cache(6, "x"), Engine("base").cache(6), Engine("y").cache(6, "y")
    engines = [under_x, under_base, under_y]
    assert cached_prefix_tokens(engines, PROMPT, "x") == [24, 0, 0]
    assert cached_prefix_tokens(engines, PROMPT, "") == [0, 24, 0]
    assert cached_prefix_tokens(engines, PROMPT, "y") == [0, 0, 24]
    for _ in range(3):  # no rotation: the cache decides
        assert router.choose(engines, PROMPT, "x").address == "x"
        assert router.choose(engines, PROMPT).address == "base"
        assert router.choose(engines, PROMPT, "y").address == "y"


def test_an_engine_that_reloaded_the_name_with_other_weights_has_no_hit() -> None:
    """Its blocks were computed under the old files; it now announces the new fingerprint."""
    stale = Engine("stale", adapters={"x": "33" * 32}).cache(6, "x")  # cached under FP["x"], now serves 33..
    fresh = Engine("fresh").cache(3, "x")
    assert cached_prefix_tokens([stale, fresh], PROMPT, "x") == [0, 12]
    assert Router("cache-aware").choose([stale, fresh], PROMPT, "x").address == "fresh"


def test_only_engines_serving_the_adapter_get_its_requests() -> None:
    router = Router("cache-aware")
    lacking = Engine("lacking", adapters={"y": FP["y"]}).cache(6)  # the base model's cache, no x
    serving = Engine("serving", load=9)
    unannounced = Engine("old-engine", load=9, adapters={"x": ""})  # serves x, no fingerprint: no cache view
    for policy in ("cache-aware", "least-load", "prefix"):
        picks = {Router(policy).choose([lacking, serving, unannounced], PROMPT, "x").address for _ in range(6)}
        assert picks <= {"serving", "old-engine"}, policy
    assert cached_prefix_tokens([serving, unannounced], PROMPT, "x") == [0, 0]
    assert router.choose([lacking], PROMPT, "x").address == "lacking"  # nobody serves it: the engine refuses it


def test_without_enough_cache_an_engine_where_the_adapter_is_active_wins_unless_overloaded() -> None:
    router = Router("cache-aware", cache_aware=CacheAwareSettings(balance_abs_threshold=4, balance_rel_threshold=2.0))
    idle, busy_with_x = Engine("idle"), Engine("busy-x", load=3, active=frozenset({"x"}))
    assert [router.choose([idle, busy_with_x], PROMPT, "x").address for _ in range(3)] == ["busy-x"] * 3
    assert router.choose([idle, busy_with_x], PROMPT, "y").address == "idle"  # y is active nowhere
    assert router.choose([idle, busy_with_x], PROMPT).address == "idle"  # the base model: by load
    busy_with_x.load = 9  # 9 - 0 > 4 and 9 > 2 x 0: overloaded
    assert router.choose([idle, busy_with_x], PROMPT, "x").address == "idle"


def test_equal_cache_hits_go_where_the_adapter_is_active_and_a_longer_hit_beats_residency() -> None:
    router = Router("cache-aware")
    a, b = Engine("a").cache(5, "x"), Engine("b", load=2, active=frozenset({"x"})).cache(5, "x")
    assert [router.choose([a, b], PROMPT, "x").address for _ in range(3)] == ["b"] * 3
    a.cache(6, "x")
    assert router.choose([a, b], PROMPT, "x").address == "a"


def test_least_load_breaks_ties_toward_the_active_adapter_and_prefix_keys_include_it() -> None:
    cold, warm = Engine("cold"), Engine("warm", active=frozenset({"x"}))
    router = Router("least-load")
    assert [router.choose([cold, warm], PROMPT, "x").address for _ in range(4)] == ["warm"] * 4
    assert {router.choose([cold, warm], PROMPT).address for _ in range(4)} == {"cold", "warm"}
    assert router._prefix_key([cold], PROMPT, "x") != router._prefix_key([cold], PROMPT, "y")
    assert router._prefix_key([cold], PROMPT) == router._prefix_key([cold], PROMPT, "")


def test_a_connection_reads_adapters_from_engine_info_and_activity_from_scheduler_stats() -> None:
    connection = EngineConnection("e", client=None)  # type: ignore[arg-type]
    assert connection.lora_fingerprint("x") is None
    connection.info = epb.EngineInfo(lora_adapters=["x", "old"],
                                     lora_adapter_infos=[epb.LoraAdapterInfo(lora_name="x", lora_id=1, fingerprint="f")])
    assert (connection.lora_fingerprint("x"), connection.lora_fingerprint("old"), connection.lora_fingerprint("z")) \
        == ("f", "", None)
    stats = epb.SchedulerStats(num_running=2, num_waiting=1, running_lora_adapters={"x": 1},
                               waiting_lora_adapters={"y": 1})
    connection.note_stats(stats)
    assert connection.active_adapters == {"x", "y"}
    connection.note_stats(epb.EngineLoad(num_running=1))  # GetLoad does not say which: kept
    assert connection.active_adapters == {"x", "y"}
    connection.note_stats(epb.EngineLoad(num_running=0, num_waiting=0))  # idle: nothing is active
    assert connection.active_adapters == frozenset()
