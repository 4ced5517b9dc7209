"""The seam between the model and the attention implementation.

KV cache layout, per layer: `kv_cache` is a tensor of shape
    [2, num_blocks, block_size, num_kv_heads, head_dim]
where index 0 holds keys and 1 holds values. Token slot `s` lives at block `s // block_size`,
offset `s % block_size`. A backend may order a block's two middle dims differently: it allocates its
caches with `kv_cache_shape` (the torch backend keeps blocks head-major, [.., num_kv_heads, block_size, ..]);
blocks, slots and the bytes per block are the same either way.

A batch is ragged: requests are laid out one after another in the flattened token dimension. Request
`i` owns query tokens `query_start_loc[i] : query_start_loc[i+1]`; its context after this step has
`seq_lens[i]` tokens, whose K/V are in the blocks `block_table[i, :ceil(seq_lens[i]/block_size)]`. The
query tokens are the *last* `q_len_i` positions of that context (positions seq_len - q_len .. seq_len-1),
and attention is causal within that frame. A decode is simply q_len == 1; a prefill chunk after a prefix
hit has q_len < seq_len.

A backend's `forward` first writes the new K/V into the cache through `slot_mapping` (one slot per
query token; skipped when the caller says `kv_written`, because a fused kernel already did it), then
attends over the cache. Backends must not depend on anything beyond this metadata.

Two per-layer options (gpt-oss uses both): `sliding_window` W restricts a query at position p to keys at
positions p - W < k <= p (transformers' sliding-window mask); `sinks` adds one learned logit per query
head to the softmax's denominator (a key every query sees, with a zero value), as gpt-oss's attention
sinks do.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each query token's K/V
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_reqs] int32: context length including this step's tokens
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    max_query_len: int
    max_seq_len: int
    # Host-side copies, so a CPU backend can plan without device syncs.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # Requests [0, num_decodes) all have q_len == 1 (the runner orders decodes first).
    num_decodes: int = 0
    # Hybrid KV groups (engine_svc/kv/groups.py): group g's metadata, with its slots and block table; a
    # layer of group g reads `groups[g]`. None: every layer reads this one.
    groups: list[AttentionMetadata] | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


def with_kv_groups(meta: AttentionMetadata, group_slots: torch.Tensor, num_groups: int) -> AttentionMetadata:
    """`meta` with `groups` set: group g's slot mapping is `group_slots[g]`, its block table the columns
    g, g + num_groups, ... of `meta.block_table` (the interleaved tables of engine_svc/kv/groups.py),
    made contiguous (kernels assume unit column stride)."""
    table = meta.block_table
    meta.groups = [replace(meta, slot_mapping=group_slots[g], block_table=table[:, g::num_groups].contiguous())
                   for g in range(num_groups)]
    return meta


class AttentionBackend(Protocol):
    """One instance per engine; stateless between calls."""

    name: str

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """The shape of one layer's cache in this backend's layout."""
        ...

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
        meta: AttentionMetadata,
        scale: float,
        kv_written: bool = False,  # this step's key/value are already in kv_cache
        sinks: torch.Tensor | None = None,  # [num_heads] learned sink logits (gpt-oss), or None
        sliding_window: int | None = None,  # attend to the last `sliding_window` positions only, or all
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...
