"""Reference paged attention in plain torch (runs on any device).

Per call: write this step's K/V into the cache through `slot_mapping`, then attend.
- Decodes (requests [0, num_decodes), q_len == 1) are attended in one batch: their context is gathered
  from the cache into a padded, contiguous [B * Hkv, L, D] (L = the longest decode context), q is
  reshaped to [B * Hkv, group, D] (GQA without repeating K/V), then masked softmax with two batched
  matmuls. Pad positions re-read the request's last real slot (always written, so finite) and are
  masked out.
- Prefill chunks run one SDPA call per request: `is_causal` when the chunk is the whole context,
  otherwise the context is gathered from the cache and the causal mask is offset by seq_len - q_len.

Planning (gather indices, masks, token ranges) uses only the host lists in the metadata and is done
once per step: the plan is memoised on the metadata object, which every layer of a step shares (so all
layers must have the same KV head count, head grouping and dtype, as in every supported model).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine_svc.attention.backend import AttentionMetadata

_PLAN_ATTR = "_torch_attention_plan"


@dataclass
class _PrefillPlan:
    start: int  # first query token of the request in the flattened batch
    end: int
    context_slots: torch.Tensor | None  # [seq_len] int64 cache slots; None when q_len == seq_len
    mask: torch.Tensor | None  # [q_len, seq_len] additive (0 or -inf); None means is_causal


@dataclass
class _DecodePlan:
    num: int  # B: requests [0, B) are decodes
    rows: torch.Tensor  # [B * Hkv * L] int64 rows of the cache viewed as [2, slots * Hkv, D]
    context_len: int  # L = the longest decode context
    mask: torch.Tensor  # [B * Hkv, group, L] additive (0 = attend, -inf = padding)


@dataclass
class _Plan:
    decode: _DecodePlan | None
    prefills: list[_PrefillPlan]


def _additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where `allowed`, -inf elsewhere: SDPA adds a float mask directly (a bool one is converted on
    every call)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf")
    )


def _context_slots(block_table_row: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slot of each context position (positions may be any integer tensor shape)."""
    blocks = block_table_row.long().gather(-1, positions // block_size)
    return blocks * block_size + positions % block_size


def _plan_decodes(
    meta: AttentionMetadata, block_size: int, num_kv_heads: int, group: int, dtype: torch.dtype
) -> _DecodePlan:
    num = meta.num_decodes
    context_len = max(meta.seq_lens_cpu[:num])
    device = meta.block_table.device
    positions = torch.arange(context_len, device=device)
    seq_lens = meta.seq_lens[:num].long().unsqueeze(1)
    clamped = torch.minimum(positions.unsqueeze(0), seq_lens - 1)
    slots = _context_slots(meta.block_table[:num], clamped, block_size)  # [B, L]
    heads = torch.arange(num_kv_heads, device=device).view(1, num_kv_heads, 1)
    rows = slots.unsqueeze(1) * num_kv_heads + heads  # [B, Hkv, L]
    allowed = (positions.unsqueeze(0) < seq_lens).view(num, 1, 1, context_len)
    allowed = allowed.expand(num, num_kv_heads, group, context_len).reshape(-1, group, context_len)
    return _DecodePlan(num, rows.view(-1), context_len, _additive_mask(allowed, dtype))


def _plan_prefills(meta: AttentionMetadata, block_size: int, dtype: torch.dtype) -> list[_PrefillPlan]:
    plans = []
    device = meta.block_table.device
    start = meta.num_decodes  # each decode owns exactly one query token
    for i in range(meta.num_decodes, meta.num_reqs):
        q_len, seq_len = meta.query_lens_cpu[i], meta.seq_lens_cpu[i]
        slots = mask = None
        if seq_len != q_len:
            positions = torch.arange(seq_len, device=device)
            slots = _context_slots(meta.block_table[i], positions, block_size)
            causal = torch.ones(q_len, seq_len, dtype=torch.bool, device=device).tril(seq_len - q_len)
            mask = _additive_mask(causal, dtype)
        plans.append(_PrefillPlan(start, start + q_len, slots, mask))
        start += q_len
    return plans


def _get_plan(
    meta: AttentionMetadata, block_size: int, num_kv_heads: int, group: int, dtype: torch.dtype
) -> _Plan:
    plan = meta.__dict__.get(_PLAN_ATTR)
    if plan is None:
        decode = _plan_decodes(meta, block_size, num_kv_heads, group, dtype) if meta.num_decodes else None
        plan = _Plan(decode, _plan_prefills(meta, block_size, dtype))
        meta.__dict__[_PLAN_ATTR] = plan
    return plan


class TorchAttentionBackend:
    """Stateless paged attention; see the module docstring for the algorithm."""

    name = "torch"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        flat_cache = kv_cache.view(2, -1, num_kv_heads, head_dim)
        flat_cache[0].index_copy_(0, meta.slot_mapping, key)
        flat_cache[1].index_copy_(0, meta.slot_mapping, value)

        plan = _get_plan(meta, block_size, num_kv_heads, query.shape[1] // num_kv_heads, query.dtype)
        parts = []
        if plan.decode is not None:
            parts.append(self._decode(query[: plan.decode.num], kv_cache, plan.decode, scale))
        for prefill in plan.prefills:
            parts.append(self._prefill(query, key, value, flat_cache, prefill, scale))
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts) if parts else torch.empty_like(query)

    @staticmethod
    def _decode(query: torch.Tensor, kv_cache: torch.Tensor, plan: _DecodePlan, scale: float) -> torch.Tensor:
        num, num_heads, head_dim = query.shape
        num_kv_heads = kv_cache.shape[3]
        context = kv_cache.view(2, -1, head_dim).index_select(1, plan.rows)
        keys, values = context.view(2, num * num_kv_heads, plan.context_len, head_dim).unbind(0)
        q = query.reshape(num * num_kv_heads, num_heads // num_kv_heads, head_dim)
        scores = torch.baddbmm(plan.mask, q, keys.transpose(1, 2), alpha=scale)
        if scores.dtype == torch.float32:
            probs = scores.softmax(-1)
        else:  # softmax in float32, as HF does
            probs = scores.softmax(-1, dtype=torch.float32).to(scores.dtype)
        return torch.bmm(probs, values).view(num, num_heads, head_dim)

    @staticmethod
    def _prefill(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        flat_cache: torch.Tensor,
        plan: _PrefillPlan,
        scale: float,
    ) -> torch.Tensor:
        q = query[plan.start : plan.end].transpose(0, 1)
        if plan.context_slots is None:
            k, v = key[plan.start : plan.end], value[plan.start : plan.end]
        else:
            k, v = flat_cache.index_select(1, plan.context_slots).unbind(0)
        gqa = q.shape[0] != k.shape[1]
        out = F.scaled_dot_product_attention(
            q,
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=plan.mask,
            is_causal=plan.mask is None,
            scale=scale,
            enable_gqa=gqa,
        )
        return out.transpose(0, 1)
