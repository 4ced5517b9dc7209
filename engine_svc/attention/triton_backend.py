"""Paged attention through the Triton kernels in `kernels/` (CUDA natively, CPU under TRITON_INTERPRET=1).

Per call: `kv_write` puts this step's K/V into the cache through `slot_mapping` (slot -1 = padding,
skipped; not needed when the model's fused RoPE kernel already wrote them: `kv_written`), then `unified_paged_attention` runs one kernel over the whole ragged batch (decodes and
prefill chunks with context alike). Uses only the device tensors of the metadata plus the two
host ints max_query_len / max_seq_len, so it never syncs with the device.
"""

from __future__ import annotations

import torch

from engine_svc.attention.backend import AttentionMetadata
from kernels._triton import require_triton


class TritonAttentionBackend:
    """Stateless; construction fails with install advice when triton is missing."""

    name = "triton"

    def __init__(self) -> None:
        require_triton()
        from kernels.kv_write import kv_write
        from kernels.paged_attention import unified_paged_attention

        self._kv_write = kv_write
        self._attend = unified_paged_attention

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """The contract's layout (engine_svc/attention/backend.py), which the kernels index."""
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_written: bool = False,
        sinks: torch.Tensor | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        if not kv_written:
            self._kv_write(key, value, kv_cache, meta.slot_mapping)
        return self._attend(
            query,
            kv_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_table,
            scale,
            meta.max_query_len,
            meta.max_seq_len,
            sinks=sinks,
            sliding_window=sliding_window,
        )
