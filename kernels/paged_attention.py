"""Unified paged attention: one Triton kernel for a ragged batch of prefill chunks and decodes.

Work decomposition (grid = (query blocks, kv heads, kv splits)):
- A program owns one *query block* of one request and one KV head. Its BLOCK_M rows are
  BLOCK_Q query tokens x QPK query heads (the heads sharing that KV head: GQA/MQA), so K/V tiles are
  read once per head group and QK^T is a real `tl.dot` even for a single decode token (BLOCK_M is
  padded up to >= 16; rows past BLOCK_Q * QPK or past the request's q_len are masked).
- Query blocks of request i are numbered from qsl[i] // BLOCK_Q + i, an upper bound on the number of
  blocks of requests 0..i-1, so the grid needs no host sync: T // BLOCK_Q + num_reqs programs, each
  binary-searches query_start_loc for its request and exits if it lies past that request's q_len.
  For decode-only batches (max_query_len == 1) program i simply is request i.
- The program walks the context in tiles of TILE key positions, looking up each key's cache block in
  the block table (so any block_size works, and a tile may span several cache blocks), with an online
  softmax accumulated in fp32 (base-2 exponent). Keys past the causal frontier are masked.
- With NUM_SPLITS > 1 (flash-decoding), the context tiles are split across the third grid axis; each
  split writes an unnormalised partial (acc, max, sum) and `_reduce_splits_kernel` merges them. This
  keeps the GPU busy when num_reqs * num_kv_heads is small and contexts are long. How many splits:
  `choose_num_splits`, a pure function of (SMs, batch, kv heads, context, tile).
- Each split gets at least MIN_TILES tiles, whatever NUM_SPLITS is, so a request whose context is short
  (e.g. a CUDA graph captured with the longest context, replayed for a short one) uses only its first
  few splits; the others exit at once, storing just (max = -inf, sum = 0), and the reduction never
  reads their accumulators.

Head sizes that are not a power of two (40, 72, 80, 96, ...) are padded to HEAD_DIM_P with masked loads.

Per layer, optionally (gpt-oss): a sliding window W (a query at position p sees keys p - W < k <= p; the
tiles wholly before a query block's window are not visited) and attention sinks (one logit per query head
joining the softmax's denominator: folded into the running max and sum once, when the row is finished -
in the reduction when the context was split).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from kernels._triton import LazyKernel, check_device, interpret_mode, next_power_of_2, require_triton

# Bound to `triton.language` by LazyKernel at first launch; importing this module never imports triton.
tl: Any = None

_LOG2E = 1.4426950408889634
_SM_COUNT: dict[int, int] = {}

# Split-KV policy (see choose_num_splits). Values chosen from FlashInfer's and vLLM's heuristics and this
# kernel's GPU figures (BENCHMARKS.md, "The GPU engine"); re-tuned with bench/kernel_attention.py --splits /
# --tile-size on a GPU.
PREFERRED_KEYS_PER_SPLIT = 128  # FlashInfer's smallest KV chunk: shorter splits cost more in partials ...
MIN_KEYS_PER_SPLIT = 64  # ... but down to this many keys when that is what it takes to fill every SM once
MIN_CONTEXT_TO_SPLIT = 512  # below this one program is quick; a split adds a reduce launch for nothing
ENOUGH_WAVES = 2  # programs >= ENOUGH_WAVES * SMs: the grid already keeps every SM busy
TARGET_PROGRAMS_PER_SM = 4  # otherwise split until about this many programs per SM
MAX_SPLITS = 64

# Decode launch shape (q_len 1 everywhere): keys per inner step and the launch's warps / software-pipeline
# stages (absent = triton's default, 3 on Hopper). Chosen by `bench/kernel_attention.py --sweep` on an H200
# (BENCHMARKS.md, "The GPU figures, measured: NVIDIA H200"): 32 keys and 2 warps won over the block-size
# tile with 4 warps, stages 2-4 equal. A 16-row dot with 32 keys is too little work for 4 warps to share.
# Swept at head_dim 128 only, so larger heads (whose tiles
# hold twice the registers) keep triton's defaults. TANDEM_DECODE_ATTENTION="tile=64,warps=4,stages=3"
# overrides any of them for a process (read once, at import), so a sweep's pick can be run end to end.
DECODE_DEFAULTS: dict[str, int] = {"tile": 32, "warps": 2}
DECODE_DEFAULTS_MAX_HEAD_DIM = 128
DECODE_ENV = "TANDEM_DECODE_ATTENTION"
DECODE_KEYS = ("tile", "warps", "stages")


def parse_decode_config(text: str) -> dict[str, int]:
    """"tile=64,warps=4,stages=3" (any subset) -> {"tile": 64, ...}; a clear error for anything else."""
    config: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in DECODE_KEYS or not value.isdigit() or int(value) < 1:
            raise ValueError(f"{DECODE_ENV}: {item!r} is not one of {'/'.join(DECODE_KEYS)}=<positive int>")
        config[key] = int(value)
    tile = config.get("tile")
    if tile is not None and (tile < 16 or tile & (tile - 1)):
        raise ValueError(f"{DECODE_ENV}: tile must be a power of two >= 16, got {tile}")
    return config


DECODE_OVERRIDE: dict[str, int] = parse_decode_config(os.environ.get(DECODE_ENV, ""))


def decode_launch_config(head_dim_p: int) -> dict[str, int]:
    """The decode launch shape for a (padded) head size: the tuned defaults where they were measured,
    then the environment's override."""
    tuned = DECODE_DEFAULTS if head_dim_p <= DECODE_DEFAULTS_MAX_HEAD_DIM else {}
    return {**tuned, **DECODE_OVERRIDE}


def _attention_kernel(
    q_ptr,
    kv_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    qsl_ptr,
    seq_lens_ptr,
    bt_ptr,
    scale_log2,
    num_reqs,
    sinks_ptr,
    window,
    stride_q_t,
    stride_q_h,
    stride_kv_kind,
    stride_kv_blk,
    stride_kv_slot,
    stride_kv_head,
    stride_o_t,
    stride_o_h,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    QPK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    MIN_TILES: tl.constexpr,
    DECODE_ONLY: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # --- which request / query block this program owns ---
    if DECODE_ONLY:
        req = pid
        q_block = 0
    else:
        lo = 0
        hi = num_reqs - 1
        while lo < hi:  # largest req with qsl[req] // BLOCK_Q + req <= pid
            mid = (lo + hi + 1) // 2
            first_block = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
            go_right = first_block <= pid
            lo = tl.where(go_right, mid, lo)
            hi = tl.where(go_right, hi, mid - 1)
        req = lo
        q_block = pid - (tl.load(qsl_ptr + req) // BLOCK_Q + req)
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len  # absolute position of the request's first query token

    # --- this program's rows: (query token, query head in the kv head's group) ---
    rows = tl.arange(0, BLOCK_M)
    q_tok = q_block * BLOCK_Q + rows // QPK
    q_head = kv_head * QPK + rows % QPK
    row_ok = (rows < BLOCK_Q * QPK) & (q_tok < q_len)

    # --- the key range this program (and split) visits ---
    kv_end = tl.minimum(seq_len, ctx_len + (q_block + 1) * BLOCK_Q)  # past the block's last position
    num_tiles = tl.cdiv(kv_end, TILE)
    tile_first = 0
    if USE_WINDOW:  # the block's first query sees nothing before its window
        tile_first = tl.maximum(ctx_len + q_block * BLOCK_Q - window + 1, 0) // TILE
    tiles_per_split = tl.maximum(tl.cdiv(num_tiles - tile_first, NUM_SPLITS), MIN_TILES)
    tile_lo = tile_first + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    if NUM_SPLITS > 1:
        # partials laid out [T, Hq, NUM_SPLITS, HEAD_DIM_P] and [T, Hq, NUM_SPLITS, 2] (max, sum)
        part_row = ((q_start + q_tok).to(tl.int64) * (QPK * tl.num_programs(1)) + q_head) * NUM_SPLITS + split
        if tile_lo >= num_tiles:  # an empty split: the reduction skips its accumulator
            tl.store(part_ml_ptr + part_row * 2, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_ok)
            tl.store(part_ml_ptr + part_row * 2 + 1, tl.zeros([BLOCK_M], tl.float32), mask=row_ok)
            return

    q_pos = ctx_len + q_tok
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM
    q_row = (q_start + q_tok).to(tl.int64) * stride_q_t + q_head * stride_q_h
    q = tl.load(q_ptr + q_row[:, None] + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if DOT_IN_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    bt_row = bt_ptr + req * stride_bt
    kv_head_off = kv_head.to(tl.int64) * stride_kv_head
    for t in range(tile_lo, tile_hi):
        k_pos = t * TILE + tl.arange(0, TILE)
        k_ok = k_pos < kv_end
        blk = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        k_off = blk * stride_kv_blk + (k_pos % BLOCK_SIZE) * stride_kv_slot + kv_head_off
        if HEAD_DIM == HEAD_DIM_P:  # keep the mask uniform along the contiguous dim (vector loads)
            kv_mask = k_ok[:, None]
        else:
            kv_mask = k_ok[:, None] & dim_ok[None, :]
        k = tl.load(kv_ptr + k_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(kv_ptr + stride_kv_kind + k_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, TILE]
        visible = row_ok[:, None] & k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        if HAS_SINKS:  # the sink joins the denominator: one more logit, no value
            sink = tl.load(sinks_ptr + q_head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            m_fin = tl.maximum(m_i, sink)
            rescale = tl.math.exp2(m_i - m_fin)
            l_i = l_i * rescale + tl.math.exp2(sink - m_fin)
            acc = acc * rescale[:, None]
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_row = (q_start + q_tok).to(tl.int64) * stride_o_t + q_head * stride_o_h
        tl.store(
            out_ptr + o_row[:, None] + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )
    else:
        tl.store(
            part_acc_ptr + part_row[:, None] * HEAD_DIM_P + dims[None, :],
            acc,
            mask=row_ok[:, None],
        )
        tl.store(part_ml_ptr + part_row * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part_row * 2 + 1, l_i, mask=row_ok)


def _reduce_splits_kernel(
    part_acc_ptr,
    part_ml_ptr,
    out_ptr,
    sinks_ptr,
    num_heads,
    stride_o_t,
    stride_o_h,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_P)
    split_ok = splits < NUM_SPLITS
    dims = tl.arange(0, HEAD_DIM_P)
    base = (tok * num_heads + head) * NUM_SPLITS + splits
    m = tl.load(part_ml_ptr + base * 2, mask=split_ok, other=float("-inf"))
    l_part = tl.load(part_ml_ptr + base * 2 + 1, mask=split_ok, other=0.0)
    m_max = tl.max(m, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        m_max = tl.maximum(m_max, sink)
    weight = tl.where(m == float("-inf"), 0.0, tl.math.exp2(m - m_max))  # empty splits weigh 0
    total = tl.sum(weight * l_part, axis=0)
    if HAS_SINKS:
        total += tl.math.exp2(sink - m_max)
    visited = split_ok & (m > float("-inf"))  # empty splits never wrote an accumulator
    acc = tl.load(
        part_acc_ptr + base[:, None] * HEAD_DIM_P + dims[None, :], mask=visited[:, None], other=0.0
    )
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + tok * stride_o_t + head * stride_o_h + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


_attention = LazyKernel(_attention_kernel)
_reduce_splits = LazyKernel(_reduce_splits_kernel)


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def choose_num_splits(num_sms: int, batch: int, kv_heads: int, context: int, tile: int) -> int:
    """KV splits for a launch of `batch` query blocks x `kv_heads` programs over contexts up to `context`.

    Flash-decoding's trade: more splits put more programs on the SMs (memory bandwidth needs several
    resident programs per SM), but each split writes a partial and the reduction reads it back.
    - No split when the grid already has ENOUGH_WAVES programs per SM, or the context is shorter than
      MIN_CONTEXT_TO_SPLIT (one program finishes quickly; a reduce launch would cost more).
    - Otherwise aim for TARGET_PROGRAMS_PER_SM programs per SM (as FlashInfer sizes its grid to the
      occupancy limit), keeping >= PREFERRED_KEYS_PER_SPLIT keys per split and <= MAX_SPLITS splits;
      if that leaves SMs idle, settle for one full wave with >= MIN_KEYS_PER_SPLIT keys per split;
    - then the fewest splits with the same tiles per split, so that no split is left empty.
    """
    programs = batch * kv_heads
    if programs < 1 or context < MIN_CONTEXT_TO_SPLIT or programs >= ENOUGH_WAVES * num_sms:
        return 1
    tiles = -(-context // tile)
    wanted = -(-TARGET_PROGRAMS_PER_SM * num_sms // programs)
    splits = min(wanted, MAX_SPLITS, tiles // min_tiles_per_split(tile, PREFERRED_KEYS_PER_SPLIT))
    if programs * splits < num_sms:
        one_wave = -(-num_sms // programs)
        splits = max(splits, min(one_wave, MAX_SPLITS, tiles // min_tiles_per_split(tile)))
    splits = max(1, splits)
    # As many splits of equal tiles as that allows (rounding the share down keeps the full wave), then
    # the count the kernel's own share, max(ceil(tiles / n), MIN_TILES), really keeps busy.
    share = max(min_tiles_per_split(tile), tiles // splits)
    splits = min(MAX_SPLITS, -(-tiles // share))
    share = max(min_tiles_per_split(tile), -(-tiles // splits))
    return -(-tiles // share)


def min_tiles_per_split(tile: int, min_keys: int = MIN_KEYS_PER_SPLIT) -> int:
    """Tiles of `tile` keys that make at least `min_keys` keys."""
    return max(1, -(-min_keys // tile))


def _auto_num_splits(device: torch.device, batch: int, kv_heads: int, max_seq_len: int, tile: int) -> int:
    """`choose_num_splits` for this device; 1 on CPU (the interpreter gains nothing from splits)."""
    if device.type != "cuda":
        return 1
    return choose_num_splits(_sm_count(device), batch, kv_heads, max_seq_len, tile)


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
    num_kv_splits: int | None = None,
    tile_size: int | None = None,
    min_keys_per_split: int = MIN_KEYS_PER_SPLIT,
    num_warps: int | None = None,
    num_stages: int | None = None,
    sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal paged attention over a ragged batch; returns [T, Hq, D] in query's dtype.

    query [T, Hq, D] (last dim contiguous); kv_cache [2, num_blocks, block_size, Hkv, D] (contiguous
    heads/dim); query_start_loc [num_reqs + 1] int32; seq_lens [num_reqs] int32; block_table
    [num_reqs, max_blocks] int32. Query token j of request i sits at position seq_lens[i] - q_len_i + j.
    max_query_len must bound every q_len (it picks the query-block shape; 1 selects the decode path);
    max_seq_len only tunes the split heuristic. Rows past query_start_loc[-1] (padding) are undefined.
    num_kv_splits (None = auto: `choose_num_splits`, 1 on CPU), tile_size (keys per inner step, power of
    two >= 16), min_keys_per_split (the floor on each split's share of a context), num_warps and
    num_stages (the launch's; decode steps default to `decode_launch_config`) are tuning knobs that never change
    the result beyond rounding. `sinks` [Hq] (sink logits, any float dtype) and `sliding_window` (keys
    p - W < k <= p only) are the per-layer options of the module docstring.
    """
    require_triton()
    check_device(query)
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    num_reqs = seq_lens.shape[0]
    out = torch.empty_like(query)
    if num_tokens == 0 or num_reqs == 0:
        return out
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads"
    assert query.dtype == kv_cache.dtype, "query and kv_cache must share a dtype"
    assert query.stride(-1) == 1, "query last dim must be contiguous"
    assert kv_cache.stride(-1) == 1 and kv_cache.stride(-2) == head_dim, (
        "kv_cache heads/dim must be contiguous"
    )
    qpk = num_heads // num_kv_heads
    decode_only = max_query_len <= 1
    if decode_only:
        block_m = max(16, next_power_of_2(qpk))
        block_q = 1
        grid_q = num_reqs
    else:
        block_m = max(64 if max_query_len >= 16 else 16, next_power_of_2(qpk))
        block_q = block_m // qpk
        grid_q = num_tokens // block_q + num_reqs
    head_dim_p = max(16, next_power_of_2(head_dim))  # tl.dot needs K >= 16
    if decode_only:
        shape = decode_launch_config(head_dim_p)
        tile_size = tile_size or shape.get("tile")
        num_warps = num_warps or shape.get("warps")
        num_stages = num_stages or shape.get("stages")
    launch: dict[str, int] = {}
    if num_warps is not None:
        launch["num_warps"] = num_warps
    if num_stages is not None:
        launch["num_stages"] = num_stages
    tile = tile_size if tile_size is not None else max(16, next_power_of_2(block_size))
    # triton 3.9's interpreter multiplies bf16 dot operands as raw uint16 bits: upcast there.
    dot_in_fp32 = query.dtype == torch.bfloat16 and interpret_mode()
    splits = num_kv_splits or _auto_num_splits(query.device, grid_q, num_kv_heads, max_seq_len, tile)
    if splits > 1:
        part_acc = torch.empty(
            num_tokens, num_heads, splits, head_dim_p, dtype=torch.float32, device=query.device
        )
        part_ml = torch.empty(num_tokens, num_heads, splits, 2, dtype=torch.float32, device=query.device)
    else:
        part_acc = part_ml = out  # unused placeholders
    _attention[(grid_q, num_kv_heads, splits)](
        query,
        kv_cache,
        out,
        part_acc,
        part_ml,
        query_start_loc,
        seq_lens,
        block_table,
        scale * _LOG2E,
        num_reqs,
        out if sinks is None else sinks,
        sliding_window or 0,
        query.stride(0),
        query.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        out.stride(0),
        out.stride(1),
        block_table.stride(0),
        HEAD_DIM=head_dim,
        HEAD_DIM_P=head_dim_p,
        QPK=qpk,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE=tile,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=splits,
        MIN_TILES=min_tiles_per_split(tile, min_keys_per_split),
        DECODE_ONLY=decode_only,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 or dot_in_fp32 else "tf32",
        DOT_IN_FP32=dot_in_fp32,
        HAS_SINKS=sinks is not None,
        USE_WINDOW=sliding_window is not None,
        **launch,
    )
    if splits > 1:
        _reduce_splits[(num_tokens, num_heads)](
            part_acc,
            part_ml,
            out,
            out if sinks is None else sinks,
            num_heads,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_P=head_dim_p,
            NUM_SPLITS=splits,
            SPLITS_P=next_power_of_2(splits),
            HAS_SINKS=sinks is not None,
        )
    return out
