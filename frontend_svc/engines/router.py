"""Picking an engine for a request.

- `cache-aware` (SGLang's and SMG's `cache_aware` policy, on an exact view of each engine's cache): each
  engine's `kv_index` holds the hashes of the KV blocks it has cached, kept exact by its KV-cache event
  stream (kv_index.py). The prompt's block hashes (shared_runtime/kv_hash.py, the engine's own function)
  are looked up in every index. If the longest cached prefix covers more than `cache_threshold` of the
  prompt, the engines holding that much get the request (the least loaded of them), unless they are
  overloaded: an engine is overloaded when it has more than `balance_abs_threshold` requests more than
  the least-loaded engine AND more than `balance_rel_threshold` times its load (SMG's per-worker test).
  Otherwise the least-loaded engine gets it (ties: the one with the longer cached prefix, then the one
  caching fewer blocks). Every frontend sees the same events, so replicas route a conversation's next
  turn to the same engine without talking to each other. The absolute threshold defaults to a quarter of
  the engine's --max-num-seqs (SGLang's 64 for vLLM's default of 256 sequences), so it means the same
  on a small engine as on a large one.
- A request on a LoRA adapter goes only to engines that serve the adapter (any engine when none does:
  the engine then refuses it, naming the adapter). Its prompt is hashed under the adapter's content
  fingerprint, as each engine announced it (EngineInfo.lora_adapter_infos, kept current by the engine's
  WatchLoraAdapters stream), with the engine's own function (shared_runtime.kv_hash.lora_extra_keys), so
  cache-aware routing is exact per adapter: the same prompt cached under another adapter, or the base
  model, is no hit. The adapter's residency acts as affinity: among the engines caching the longest
  prefix, and, when no engine caches enough, among the engines that are not overloaded, an engine where
  the adapter is active (running or waiting requests on it, per the engine's last scheduler stats: it
  holds a device slot) is preferred; `least-load` prefers one at equal load. An engine that serves the
  adapter but announced no fingerprint (an older engine) is routed to without a cache view of it.
- `pd`: prefill/decode disaggregation (frontend_svc/pd_flow.py): `cache-aware` within the pool a step
  of the request goes to (the dispatcher passes only that pool's engines).
- `least-load`: the engine with the smallest load (its last reported running + waiting, plus the
  requests this frontend sent it since that report); ties rotate so equal engines share the work.
- `prefix`: rendezvous (highest-random-weight) hashing of the prompt's first KV blocks picks the
  engine, so prompts sharing a prefix land where it is cached, and an engine joining or leaving only
  moves the prefixes it wins or held. The pick yields to the least-loaded engine when it is much more
  loaded (more than `IMBALANCE_FACTOR` times the least load plus `IMBALANCE_SLACK`). Prompts shorter
  than one block go by load.

Pure logic over anything with `address`, `load`, `block_size` (and `kv_index` for cache-aware;
`lora_fingerprint` and `active_adapters` for requests on an adapter); no I/O.
The one cost on the event loop is hashing the prompt's blocks for cache-aware routing, which stops at
the first block no engine holds.
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections.abc import Callable, Container, Sequence, Sized
from dataclasses import dataclass
from typing import Protocol, TypeVar

from shared_runtime.kv_hash import ExtraKeys, iter_block_hashes, lora_extra_keys

POLICIES = ("cache-aware", "least-load", "prefix", "pd")  # pd: cache-aware within each P/D pool
PREFIX_BLOCKS = 4
IMBALANCE_FACTOR = 2
IMBALANCE_SLACK = 8
DEFAULT_BLOCK_SIZE = 16


FALLBACK_MAX_NUM_SEQS = 256  # for an engine that does not report its batch size


@dataclass(frozen=True)
class CacheAwareSettings:
    """The cache-aware policy's thresholds, with SGLang's and SMG's defaults."""

    cache_threshold: float = 0.3  # route by cache only when the best match covers more of the prompt than this
    balance_abs_threshold: int | None = None  # overloaded: load - min load above this (None: max_num_seqs / 4) ...
    balance_rel_threshold: float = 1.5  # ... and load above this times the min load

    def absolute_threshold(self, max_num_seqs: int) -> int:
        """`balance_abs_threshold`, or for an engine running at most `max_num_seqs` a quarter of it."""
        if self.balance_abs_threshold is not None:
            return self.balance_abs_threshold
        return max(1, (max_num_seqs or FALLBACK_MAX_NUM_SEQS) // 4)

    def problems(self) -> list[str]:
        """What is out of range, phrased for the flags; empty when valid."""
        out = []
        if not 0.0 <= self.cache_threshold <= 1.0:
            out.append(f"--cache-threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold is not None and self.balance_abs_threshold < 0:
            out.append(f"--balance-abs-threshold must be >= 0, got {self.balance_abs_threshold}")
        if self.balance_rel_threshold < 1.0:
            out.append(f"--balance-rel-threshold must be >= 1, got {self.balance_rel_threshold}")
        return out


class Routable(Protocol):
    @property
    def address(self) -> str: ...
    @property
    def load(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    def lora_fingerprint(self, name: str) -> str | None: ...  # None: not served; "": served, not announced
    @property
    def active_adapters(self) -> Container[str]: ...  # adapters with requests running or waiting there


class CacheIndex(Container[bytes], Sized, Protocol):
    """The block hashes an engine has cached (frontend_svc/engines/kv_index.py)."""


class CacheAware(Routable, Protocol):
    @property
    def kv_index(self) -> CacheIndex: ...
    @property
    def max_num_seqs(self) -> int: ...  # 0: unknown


E = TypeVar("E", bound=Routable)
C = TypeVar("C", bound=CacheAware)


class Router:
    def __init__(self, policy: str = "least-load", prefix_blocks: int = PREFIX_BLOCKS,
                 cache_aware: CacheAwareSettings | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}")
        self.policy = policy
        self.prefix_blocks = prefix_blocks
        self.settings = cache_aware or CacheAwareSettings()
        self._turn = itertools.count()

    @property
    def uses_kv_events(self) -> bool:
        """Whether engines' KV-cache events must be followed for this policy."""
        return self.policy in ("cache-aware", "pd")

    def choose(self, engines: Sequence[E], prompt_token_ids: Sequence[int], lora_name: str = "") -> E | None:
        """The engine for this prompt, run under LoRA adapter `lora_name` ("" = the base model), or None
        when `engines` is empty."""
        if not engines:
            return None
        if lora_name:
            engines = [e for e in engines if e.lora_fingerprint(lora_name) is not None] or engines
        if self.policy in ("cache-aware", "pd"):
            return self._cache_aware(engines, prompt_token_ids, lora_name)  # type: ignore[type-var]
        least = self.least_loaded(engines, tie_break=_cold(lora_name) if lora_name else None)
        if self.policy == "least-load":
            return least
        key = self._prefix_key(engines, prompt_token_ids, lora_name)
        if key is None:
            return least
        pick = max(engines, key=lambda e: _weight(key, e.address))
        if pick.load > IMBALANCE_FACTOR * least.load + IMBALANCE_SLACK:
            return least
        return pick

    def least_loaded(self, engines: Sequence[E], tie_break: Callable[[E], tuple[int, ...]] | None = None) -> E:
        """The least-loaded engine (then the smallest `tie_break`); exact ties rotate."""
        def key(e: E) -> tuple[int, ...]:
            return (e.load, *(tie_break(e) if tie_break is not None else ()))

        lowest = min(key(e) for e in engines)
        tied = [e for e in engines if key(e) == lowest]
        return tied[next(self._turn) % len(tied)]

    def _cache_aware(self, engines: Sequence[C], ids: Sequence[int], lora_name: str = "") -> C:
        s = self.settings
        matched = dict(zip(engines, cached_prefix_tokens(engines, ids, lora_name)))
        best = max(matched.values())
        least = min(e.load for e in engines)
        if ids and best / len(ids) > s.cache_threshold:
            holders = [e for e, m in matched.items() if m == best and not self._overloaded(e, least)]
            if holders:
                return self.least_loaded(_resident_first(holders, lora_name))
        if lora_name:  # no engine caches enough: the adapter's residency is the affinity
            resident = [e for e in engines if lora_name in e.active_adapters and not self._overloaded(e, least)]
            engines = resident or engines
        return self.least_loaded(engines, tie_break=lambda e: (-matched[e], len(e.kv_index)))

    def _overloaded(self, engine: CacheAware, least_load: int) -> bool:
        s = self.settings
        return (engine.load - least_load > s.absolute_threshold(engine.max_num_seqs)
                and engine.load > s.balance_rel_threshold * least_load)

    def _prefix_key(self, engines: Sequence[Routable], ids: Sequence[int], lora_name: str = "") -> bytes | None:
        block = engines[0].block_size or DEFAULT_BLOCK_SIZE
        num_blocks = min(self.prefix_blocks, len(ids) // block)
        if num_blocks == 0:
            return None
        key = array("I", ids[: num_blocks * block]).tobytes()
        return lora_name.encode() + b"\0" + key if lora_name else key


def _resident_first(engines: list[C], lora_name: str) -> list[C]:
    """The engines where adapter `lora_name` is active, or all of them when it is active on none (or
    the request is on the base model)."""
    if not lora_name:
        return engines
    return [e for e in engines if lora_name in e.active_adapters] or engines


def _cold(lora_name: str) -> Callable[[Routable], tuple[int, ...]]:
    """A tie-break that puts engines where adapter `lora_name` is active first."""
    return lambda e: (0 if lora_name in e.active_adapters else 1,)


def block_hash_keys(engine: Routable, lora_name: str) -> ExtraKeys | None:
    """The extra keys `engine` hashes a prompt's blocks with under adapter `lora_name` (() for the base
    model), or None when it cannot be known (the engine announced no fingerprint for the adapter)."""
    if not lora_name:
        return ()
    fingerprint = engine.lora_fingerprint(lora_name)
    return lora_extra_keys(fingerprint) if fingerprint else None


def cached_prefix_tokens(engines: Sequence[CacheAware], ids: Sequence[int], lora_name: str = "") -> list[int]:
    """For each engine, how many of the prompt's leading tokens it has cached, in whole blocks, for a
    request run under adapter `lora_name` ("" = the base model).

    The prompt is hashed block by block, as the engine hashes it, only while some engine still holds
    every block so far (an engine's lookup stops at its first miss too). Engines with different block
    sizes, or different fingerprints for the adapter, are matched with hashes of their own; an engine
    whose hashes cannot be known matches nothing."""
    matched = [0] * len(engines)
    groups: dict[tuple[int, ExtraKeys], list[int]] = {}
    for i, engine in enumerate(engines):
        keys = block_hash_keys(engine, lora_name)
        if keys is not None:
            groups.setdefault((engine.block_size or DEFAULT_BLOCK_SIZE, keys), []).append(i)
    for (block_size, keys), alive in groups.items():
        for depth, block_hash in enumerate(iter_block_hashes(ids, block_size, keys), 1):
            alive = [i for i in alive if block_hash in engines[i].kv_index]
            if not alive:
                break
            for i in alive:
                matched[i] = depth * block_size
    return matched


def _weight(key: bytes, address: str) -> int:
    digest = hashlib.blake2b(key, digest_size=8, person=b"tandem-route", key=address.encode()[:64])
    return int.from_bytes(digest.digest(), "big")
