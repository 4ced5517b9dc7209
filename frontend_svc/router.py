"""Picking an engine for a request.

- `least-load`: the engine with the smallest load (its last reported running + waiting, plus the
  requests this frontend sent it since that report); ties rotate so equal engines share the work.
- `prefix`: rendezvous (highest-random-weight) hashing of the prompt's first KV blocks picks the
  engine, so prompts sharing a prefix land where it is cached, and an engine joining or leaving only
  moves the prefixes it wins or held. The pick yields to the least-loaded engine when it is much more
  loaded (more than `IMBALANCE_FACTOR` times the least load plus `IMBALANCE_SLACK`). Prompts shorter
  than one block go by load.

Pure logic over anything with `address`, `load` and `block_size`; no I/O.
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections.abc import Sequence
from typing import Protocol, TypeVar

PREFIX_BLOCKS = 4
IMBALANCE_FACTOR = 2
IMBALANCE_SLACK = 8
DEFAULT_BLOCK_SIZE = 16


class Routable(Protocol):
    @property
    def address(self) -> str: ...
    @property
    def load(self) -> int: ...
    @property
    def block_size(self) -> int: ...


E = TypeVar("E", bound=Routable)


class Router:
    def __init__(self, policy: str = "least-load", prefix_blocks: int = PREFIX_BLOCKS) -> None:
        if policy not in ("least-load", "prefix"):
            raise ValueError(f"unknown routing policy {policy!r}")
        self.policy = policy
        self.prefix_blocks = prefix_blocks
        self._turn = itertools.count()

    def choose(self, engines: Sequence[E], prompt_token_ids: Sequence[int]) -> E | None:
        """The engine for this prompt, or None when `engines` is empty."""
        if not engines:
            return None
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

    def least_loaded(self, engines: Sequence[E]) -> E:
        lowest = min(e.load for e in engines)
        tied = [e for e in engines if e.load == lowest]
        return tied[next(self._turn) % len(tied)]

    def _prefix_key(self, engines: Sequence[Routable], ids: Sequence[int]) -> bytes | None:
        block = engines[0].block_size or DEFAULT_BLOCK_SIZE
        num_blocks = min(self.prefix_blocks, len(ids) // block)
        if num_blocks == 0:
            return None
        return array("I", ids[: num_blocks * block]).tobytes()


def _weight(key: bytes, address: str) -> int:
    digest = hashlib.blake2b(key, digest_size=8, person=b"tandem-route", key=address.encode()[:64])
    return int.from_bytes(digest.digest(), "big")
