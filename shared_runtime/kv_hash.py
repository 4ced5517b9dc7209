"""Stable, chained hashes of full KV blocks: what the engine's prefix cache is keyed by, and what a
frontend computes to know which engine holds a prompt's prefix (cache-aware routing).

A full block's hash is sha256(parent_hash || canonical(token_ids) || canonical(extra_keys)). The parent of
the first block is `ROOT_HASH`, so a block hash names the whole prefix up to and including its block.

The encoding is canonical and process independent (never Python's `hash()`): the token count as a
little-endian uint32, each token id as a little-endian int64, then the extra keys as msgpack (which is
self-delimiting). Two engines, two workers, or a frontend and an engine therefore agree on every hash;
the engine uses this module (engine_svc/kv/block_hash.py), never a copy of it.

A request on a LoRA adapter hashes its blocks with `lora_extra_keys(fingerprint)`: the adapter's content
fingerprint (engine_svc/lora/fingerprint.py), which every engine announces for every adapter it serves
(EngineInfo.lora_adapter_infos). A frontend that knows the fingerprint therefore computes exactly the
hashes an engine stores for that adapter; KV of one adapter's weights never matches another's (or the
base model's), and a name loaded again with other weights gets a new fingerprint.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence

import msgspec

BlockHash = bytes
ExtraKeys = tuple[int | str, ...]

ROOT_HASH: BlockHash = hashlib.sha256(b"tandem.kv.block_hash.v1").digest()
_NO_EXTRA_KEYS = msgspec.msgpack.encode([])


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: ExtraKeys = ()
) -> BlockHash:
    """The hash of one full block whose predecessor hashed to `parent` (None for the first block)."""
    h = hashlib.sha256(ROOT_HASH if parent is None else parent)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    h.update(msgspec.msgpack.encode(list(extra_keys)) if extra_keys else _NO_EXTRA_KEYS)
    return h.digest()


def lora_extra_keys(fingerprint: str) -> tuple[str, ...]:
    """The extra keys of every block of a request run under the adapter with content `fingerprint`
    ("" = the base model: no extra keys)."""
    return ("lora", fingerprint) if fingerprint else ()


def iter_block_hashes(token_ids: Sequence[int], block_size: int, extra_keys: ExtraKeys = ()) -> Iterator[BlockHash]:
    """The hashes of the full blocks of `token_ids` (under `extra_keys`, the same for every block), first
    block first, computed lazily: a caller that stops at the first block no engine holds pays only for the
    blocks it looked at."""
    parent: BlockHash | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra_keys)
        yield parent
