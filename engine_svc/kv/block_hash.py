"""The engine's side of the chained block hashes (shared_runtime/kv_hash.py): keeping each request's
`block_hashes` up to date with its tokens.

The hash function itself lives in `shared_runtime.kv_hash`, so that a frontend computes exactly the
hashes the engine keys its prefix cache by (cache-aware routing); this module re-exports it.
"""

from __future__ import annotations

from engine_svc.request import Request
from shared_runtime.kv_hash import ROOT_HASH, BlockHash, ExtraKeys, hash_block_tokens

__all__ = ["ROOT_HASH", "BlockHash", "ExtraKeys", "extend_block_hashes", "hash_block_tokens"]


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
