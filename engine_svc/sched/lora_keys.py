"""The prefix-cache key of a request run under a LoRA adapter.

With its adapter's content fingerprint known (the registry records one for every adapter it serves,
engine_svc/lora/registry.py), a request's blocks are keyed by `shared_runtime.kv_hash.lora_extra_keys`,
which a frontend computes too (cache-aware routing per adapter). Without one (a scheduler built without
the registry, as some tests build it) the key is the adapter's name and engine-local id, which is never
reused: either way KV computed under one adapter's weights never serves another's.
"""

from __future__ import annotations

from collections.abc import Mapping

from engine_svc.request import Request
from shared_runtime.kv_hash import lora_extra_keys


def lora_block_keys(request: Request, fingerprints: Mapping[str, str]) -> tuple[str, ...]:
    """The extra keys of `request`'s block hashes (its `lora_id` is set already)."""
    fingerprint = fingerprints.get(request.lora_name, "")
    if fingerprint:
        return lora_extra_keys(fingerprint)
    return (request.lora_name, str(request.lora_id))
