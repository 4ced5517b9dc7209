"""Torch reference for `kernels.paged_attention.unified_paged_attention` (same signature).

Deliberately naive: per request, gather the context's K/V from its blocks, build the causal mask in
absolute positions, and do softmax(QK^T * scale) V in fp32.
"""

from __future__ import annotations

import torch


def gather_context(
    kv_cache: torch.Tensor, block_row: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [seq_len, Hkv, D] of one request, read through its block-table row."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    blocks = block_row[:num_blocks].long()
    k = kv_cache[0, blocks].flatten(0, 1)[:seq_len]
    v = kv_cache[1, blocks].flatten(0, 1)[:seq_len]
    return k, v


def unified_paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    *,
    sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal paged attention over a ragged batch; returns [T, Hq, D] in query's dtype.

    Query token j of request i sits at position seq_lens[i] - q_len_i + j and sees keys 0..that position.
    Query head h reads KV head h // (Hq // Hkv). max_query_len / max_seq_len are unused (kept for the
    shared signature). Rows past query_start_loc[-1] are left zero. With `sliding_window` W a query at p
    sees keys p - W < k <= p only; `sinks` [Hq] adds one logit per head to the softmax (no value).
    """
    del max_query_len, max_seq_len
    num_heads = query.shape[1]
    group = num_heads // kv_cache.shape[3]
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_lo, q_hi = starts[i], starts[i + 1]
        if q_hi == q_lo:
            continue
        k, v = gather_context(kv_cache, block_table[i], seq_len)
        k = k.float().repeat_interleave(group, dim=1)  # [S, Hq, D]
        v = v.float().repeat_interleave(group, dim=1)
        q = query[q_lo:q_hi].float()  # [Q, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(seq_len - (q_hi - q_lo), seq_len, device=query.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=query.device).unsqueeze(0)
        hidden = k_pos > q_pos
        if sliding_window is not None:
            hidden |= k_pos <= q_pos - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:
            sink = sinks.float().view(num_heads, 1, 1).expand(num_heads, scores.shape[1], 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[q_lo:q_hi] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
