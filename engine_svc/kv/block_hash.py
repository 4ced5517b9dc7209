"""Stable, chained hashes of full KV blocks, for prefix caching.

A full block's hash is sha256(parent_hash || canonical(token_ids) || canonical(extra_keys)). The parent of
the first block is `ROOT_HASH`, so a block hash names the whole prefix up to and including its block.

The encoding is canonical and process independent (never Python's `hash()`): the token count as a
little-endian uint32, each token id as a little-endian int64, then the extra keys as msgpack (which is
self-delimiting). Two engines, or two workers, therefore agree on every hash.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import msgspec

from engine_svc.request import Request

BlockHash = bytes
ExtraKeys = tuple[int | str, ...]

ROOT_HASH: BlockHash = hashlib.sha256(b"tandem.kv.block_hash.v1").digest()


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: ExtraKeys = ()
) -> BlockHash:
    """The hash of one full block whose predecessor hashed to `parent` (None for the first block)."""
    h = hashlib.sha256(ROOT_HASH if parent is None else parent)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    h.update(msgspec.msgpack.encode(list(extra_keys)))
    return h.digest()


def extend_block_hashes(request: Request, block_size: int, extra_keys: ExtraKeys = ()) -> None:
    """Append to `request.block_hashes` the hashes of the full blocks of `all_token_ids` not hashed yet.

    Invariant kept: `len(request.block_hashes) == request.num_tokens // block_size` afterwards. O(1) when
    no block has filled since the last call, so it is cheap to call after every appended token.
    """
    hashes = request.block_hashes
    tokens = request.all_token_ids
    for i in range(len(hashes), len(tokens) // block_size):
        parent = hashes[i - 1] if i else None
        hashes.append(hash_block_tokens(parent, tokens[i * block_size : (i + 1) * block_size], extra_keys))
