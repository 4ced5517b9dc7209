"""The native CPU LoRA op (engine_svc/lora/csrc/cpu_lora.cpp) against the torch reference (kernels/lora_ref.py):
mixed slots and base-model rows, an empty slot, sub-projections of unequal widths (tails of the vector and
column blocks), adapters of several ranks in one slot rank, many tokens on one slot, strided rows, float32
and bfloat16; through the slots API it equals the torch layouts, and long steps keep the torch layouts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_svc.lora import cpu_native
from engine_svc.lora.slots import LoRASlots, StepLoRA
from kernels.lora_mapping import build_mapping, split_mapping
from kernels.lora_ref import lora_expand as ref_expand
from kernels.lora_ref import lora_shrink as ref_shrink

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


@pytest.fixture(scope="module")
def op():
    module = cpu_native.native()
    if module is None:
        pytest.skip("the native LoRA op is not built here (no compiler, or TANDEM_CPU_LORA=0)")
    return module


def _weights(num_slots: int, rank: int, in_features: int, widths: list[int], ranks: list[int], seed: int):
    """Random slot weights with B's block structure; slot s holds an adapter of rank ranks[s] (<= rank), the
    rest zero padding, with its own scale (PEFT's alpha / r folded into B)."""
    gen = torch.Generator().manual_seed(seed)
    parts = len(widths)
    a = torch.randn(num_slots, parts * rank, in_features, generator=gen) / in_features**0.5
    b = torch.randn(num_slots, rank, sum(widths), generator=gen) / rank**0.5
    for s, r in enumerate(ranks):
        for p in range(parts):
            a[s, p * rank + r : (p + 1) * rank] = 0
        b[s, r:] = 0
        b[s] *= 0.5 + s  # a different scaling per slot
    return a, b, gen


def _mapping(token_slots: list[int], num_slots: int):
    buf = build_mapping(np.array(token_slots, dtype=np.int64), num_slots, len(token_slots))
    return split_mapping(torch.from_numpy(buf), len(token_slots), num_slots)


def _check(op, token_slots: list[int], num_slots: int, rank: int, in_features: int, widths: list[int],
           ranks: list[int], dtype: torch.dtype, seed: int, strided: bool = False) -> None:
    a32, b32, gen = _weights(num_slots, rank, in_features, widths, ranks, seed)
    a, b = a32.to(dtype), b32.to(dtype)
    tokens, n_out = len(token_slots), sum(widths)
    x = torch.randn(tokens, in_features + 8, generator=gen).to(dtype)
    base_full = torch.randn(tokens, n_out + 5, generator=gen).to(dtype)
    if strided:  # rows of wider buffers: row stride above the width
        x, base = x[:, 3 : 3 + in_features], base_full[:, 2 : 2 + n_out]
    else:
        x, base = x[:, :in_features].contiguous(), base_full[:, :n_out].contiguous()
    offsets = [int(v) for v in np.cumsum([0, *widths])]
    slots_t = torch.tensor(token_slots)
    want = ref_expand(ref_shrink(x, a, slots_t), b, base.clone(), slots_t, offsets)
    before, full_before = base.clone(), base_full.clone()
    m = _mapping(token_slots, num_slots)
    op.lora_add_(x, base, a, b, offsets, m.sorted_tokens, m.counts, m.starts)
    torch.testing.assert_close(base, want, **TOL[dtype])
    rows = slots_t >= 0
    assert torch.equal(base[~rows], before[~rows])  # base-model rows: exactly the base output
    if rows.any():
        assert not torch.allclose(base[rows].float(), before[rows].float())  # a real delta was added
    if strided:  # the columns beside the view are untouched
        assert torch.equal(base_full[:, :2], full_before[:, :2])
        assert torch.equal(base_full[:, 2 + n_out :], full_before[:, 2 + n_out :])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_slots_base_rows_and_unequal_parts(op, dtype: torch.dtype) -> None:
    # 4 slots of rank 8 holding ranks 8, 3, 8, 5; slot 2 receives no token; q | k | v of widths 280, 24, 24
    # (a column block of 256 and a tail); in_features 40 (a vector step and a masked tail)
    _check(op, [0, -1, 3, 1, 0, -1, 3, 3, 1, 0, 0, 3, 0, 1, 0, -1, 0, 0, 3], 4, 8, 40, [280, 24, 24],
           [8, 3, 8, 5], dtype, seed=1)


def test_many_tokens_on_one_slot_and_strided_rows(op) -> None:
    # 37 tokens on slot 1 of 3: several token blocks of a work item, several work items; strided x and out
    _check(op, [1] * 37, 3, 16, 70, [33, 40], [16, 16, 4], torch.float32, seed=2, strided=True)


def test_eight_slots_of_a_decode_batch(op) -> None:
    # the benchmark's shape class: 8 slots x 4 tokens, rank 16, q | k | v
    _check(op, [i % 8 for i in range(32)], 8, 16, 96, [96, 32, 32], [16, 8, 16, 4, 16, 2, 16, 1],
           torch.float32, seed=3)
    _check(op, [-1, -1, -1], 2, 16, 40, [72], [16, 16], torch.float32, seed=4)  # no adapter token


def test_bad_inputs_are_refused(op) -> None:
    a, b, _ = _weights(2, 4, 16, [8], [4, 4], seed=5)
    x, out = torch.randn(3, 16), torch.zeros(3, 8)
    m = _mapping([0, 1, -1], 2)
    with pytest.raises(RuntimeError, match="token index out of range"):
        op.lora_add_(x, out, a, b, [0, 8], torch.tensor([0, 5], dtype=torch.int32), m.counts, m.starts)
    with pytest.raises(RuntimeError, match="in x's dtype"):
        op.lora_add_(x, out, a.double(), b, [0, 8], m.sorted_tokens, m.counts, m.starts)
    with pytest.raises(RuntimeError, match="offsets"):
        op.lora_add_(x, out, a, b, [0, 7], m.sorted_tokens, m.counts, m.starts)
    with pytest.raises(RuntimeError, match="overrun"):
        op.lora_add_(x, out, a, b, [0, 8], m.sorted_tokens, torch.tensor([3, 3], dtype=torch.int32), m.starts)
    assert torch.equal(out, torch.zeros(3, 8))  # a refused call writes nothing


def _slots_pair(op, num_slots: int, rank: int, in_features: int, widths: list[int], seed: int):
    native_step, torch_step = StepLoRA(native=op), StepLoRA()
    pair = [LoRASlots(step, num_slots, rank, in_features, widths, torch.float32, torch.device("cpu"))
            for step in (native_step, torch_step)]
    a, b, _ = _weights(num_slots, rank, in_features, widths, [rank] * num_slots, seed)
    for s in range(num_slots):
        for slots in pair:
            slots.a[s].copy_(a[s])
            slots.b[s].copy_(b[s])
    return native_step, torch_step, pair


@pytest.mark.parametrize("token_slots", [
    [i % 8 for i in range(32)],  # the torch grouped layout
    [0] * 20,  # one slot: one-hot, product skipped
    [2, -1, 0, 0, -1, 1, 0, 0, 0, 0, 0, 0],  # uneven: one-hot
])
def test_slots_api_native_equals_the_torch_layouts(op, token_slots: list[int]) -> None:
    native_step, torch_step, (n_slots, t_slots) = _slots_pair(op, 8, 8, 48, [48, 16, 16], seed=6)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(len(token_slots), 48, generator=gen)
    base = torch.randn(len(token_slots), 80, generator=gen)
    for step in (native_step, torch_step):
        step.plan(np.array(token_slots, dtype=np.int64), torch.float32, torch.device("cpu"))
    assert native_step.native_mapping is not None and torch_step.native_mapping is None
    got = n_slots(x, base.clone())
    torch.testing.assert_close(got, t_slots(x, base.clone()), **TOL[torch.float32])
    base_rows = torch.tensor(token_slots) < 0
    assert torch.equal(got[base_rows], base[base_rows])


def test_long_steps_keep_the_torch_layouts(op) -> None:
    native_step, _, (n_slots, _) = _slots_pair(op, 2, 4, 16, [8], seed=8)
    tokens = cpu_native.NATIVE_MAX_TOKENS + 1
    token_slots = np.arange(tokens) % 2
    native_step.plan(token_slots, torch.float32, torch.device("cpu"))
    assert native_step.native_mapping is None and native_step.group_rows is not None  # grouped, in torch
    x, base = torch.randn(tokens, 16), torch.randn(tokens, 8)
    want = ref_expand(ref_shrink(x, n_slots.a, torch.from_numpy(token_slots)), n_slots.b, base.clone(),
                      torch.from_numpy(token_slots), [0, 8])
    torch.testing.assert_close(n_slots(x, base.clone()), want, **TOL[torch.float32])
    native_step.plan(np.full(4, -1), torch.float32, torch.device("cpu"))  # no adapter: nothing to do
    assert native_step.num_slots == 0 and native_step.native_mapping is None


def test_native_op_chosen_by_device_and_switch(op, monkeypatch) -> None:
    assert cpu_native.native_for(torch.device("cpu"), torch.float32) is op
    assert cpu_native.native_for(torch.device("cpu"), torch.float16) is None
    assert cpu_native.native_for(torch.device("cuda"), torch.float32) is None
    assert StepLoRA(kernels=True, slots=1, capacity=1, native=op).native is None  # the kernels serve
    cpu_native.native.cache_clear()
    monkeypatch.setenv(cpu_native.NATIVE_ENV, "0")
    try:
        assert cpu_native.native() is None
    finally:
        cpu_native.native.cache_clear()


def test_slots_api_with_transposed_input_and_output(op) -> None:
    """x and out of column stride != 1 (the op reads unit-stride rows): the delta still lands in out."""
    native_step, torch_step, (n_slots, t_slots) = _slots_pair(op, 3, 4, 24, [16, 8], seed=9)
    token_slots = np.array([2, 0, -1, 1, 0], dtype=np.int64)
    for step in (native_step, torch_step):
        step.plan(token_slots, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(10)
    x_t, out_t = torch.randn(24, 5, generator=gen), torch.randn(24, 5, generator=gen)
    want = t_slots(x_t.t().contiguous(), out_t.t().contiguous())
    out = out_t.t()  # a view of out_t: written through
    got = n_slots(x_t.t(), out)
    assert got is out
    torch.testing.assert_close(out_t.t(), want, **TOL[torch.float32])
