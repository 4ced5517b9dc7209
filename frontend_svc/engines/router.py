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
- `pd`: prefill/decode disaggregation (frontend_svc/pd_flow.py): `cache-aware` within the pool a step
  of the request goes to (the dispatcher passes only that pool's engines).
- `least-load`: the engine with the smallest load (its last reported running + waiting, plus the
  requests this frontend sent it since that report); ties rotate so equal engines share the work.
- `prefix`: rendezvous (highest-random-weight) hashing of the prompt's first KV blocks picks the
  engine, so prompts sharing a prefix land where it is cached, and an engine joining or leaving only
  moves the prefixes it wins or held. The pick yields to the least-loaded engine when it is much more
  loaded (more than `IMBALANCE_FACTOR` times the least load plus `IMBALANCE_SLACK`). Prompts shorter
  than one block go by load.

Pure logic over anything with `address`, `load`, `block_size` (and `kv_index` for cache-aware); no I/O.
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

from shared_runtime.kv_hash import iter_block_hashes

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

    def choose(self, engines: Sequence[E], prompt_token_ids: Sequence[int]) -> E | None:
        """The engine for this prompt, or None when `engines` is empty."""
        if not engines:
            return None
        if self.policy in ("cache-aware", "pd"):
            return self._cache_aware(engines, prompt_token_ids)  # type: ignore[type-var]
        least = self.least_loaded(engines)
        if self.policy == "least-load":
            return least
        key = self._prefix_key(engines, prompt_token_ids)
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

    def _cache_aware(self, engines: Sequence[C], ids: Sequence[int]) -> C:
        s = self.settings
        matched = dict(zip(engines, cached_prefix_tokens(engines, ids)))
        best = max(matched.values())
        if ids and best / len(ids) > s.cache_threshold:
            least = min(e.load for e in engines)
            holders = [e for e, m in matched.items() if m == best and not self._overloaded(e, least)]
            if holders:
                return self.least_loaded(holders)
        return self.least_loaded(engines, tie_break=lambda e: (-matched[e], len(e.kv_index)))

    def _overloaded(self, engine: CacheAware, least_load: int) -> bool:
        s = self.settings
        return (engine.load - least_load > s.absolute_threshold(engine.max_num_seqs)
                and engine.load > s.balance_rel_threshold * least_load)

    def _prefix_key(self, engines: Sequence[Routable], ids: Sequence[int]) -> bytes | None:
        block = engines[0].block_size or DEFAULT_BLOCK_SIZE
        num_blocks = min(self.prefix_blocks, len(ids) // block)
        if num_blocks == 0:
            return None
        return array("I", ids[: num_blocks * block]).tobytes()


def cached_prefix_tokens(engines: Sequence[CacheAware], ids: Sequence[int]) -> list[int]:
    """For each engine, how many of the prompt's leading tokens it has cached, in whole blocks.

    The prompt is hashed block by block, as the engine hashes it, only while some engine still holds
    every block so far (an engine's lookup stops at its first miss too). Engines with different block
    sizes are matched with hashes of their own block size."""
    matched = [0] * len(engines)
    by_block_size: dict[int, list[int]] = {}
    for i, engine in enumerate(engines):
        by_block_size.setdefault(engine.block_size or DEFAULT_BLOCK_SIZE, []).append(i)
    for block_size, alive in by_block_size.items():
        for depth, block_hash in enumerate(iter_block_hashes(ids, block_size), 1):
            alive = [i for i in alive if block_hash in engines[i].kv_index]
            if not alive:
                break
            for i in alive:
                matched[i] = depth * block_size
    return matched


def _weight(key: bytes, address: str) -> int:
    digest = hashlib.blake2b(key, digest_size=8, person=b"tandem-route", key=address.encode()[:64])
    return int.from_bytes(digest.digest(), "big")
