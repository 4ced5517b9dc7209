"""The LoRA slots API on the Triton kernel path (interpreted on CPU) against the torch path: the same delta
for a run of steps (mixed slots and base tokens, one slot, no adapter, a slot swapped in between), with
every buffer a CUDA graph would read keeping its address; and the path chosen by device."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_svc.lora.slots import LoRASlots, StepLoRA, kernels_wanted
from engine_svc.worker.staging import StepStaging
from kernels import lora_expand, lora_shrink
from kernels._triton import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

SUBS, RANK, D_IN, SLOTS, CAPACITY = [12, 4, 4], 4, 16, 3, 16


def _adapter(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(a [P*R, in], b [P*R, out]) with B's block structure (rank block p -> p's columns)."""
    width = RANK * len(SUBS)
    b = torch.zeros(width, sum(SUBS))
    col = 0
    for p, size in enumerate(SUBS):
        b[p * RANK : (p + 1) * RANK, col : col + size] = torch.randn(RANK, size, generator=gen)
        col += size
    return torch.randn(width, D_IN, generator=gen), b


@pytest.mark.parametrize("staged", [False, True])
def test_kernel_path_equals_the_torch_path_with_fixed_buffers(device, staged: bool) -> None:
    """`staged`: the mapping goes up through the worker's double-buffered step staging (a copy between
    two tensors on CPU), as in an engine; else by a synchronous copy."""
    gen = torch.Generator().manual_seed(0)
    k_step = StepLoRA(kernels=True, slots=SLOTS, capacity=CAPACITY, device=device)
    staging = StepStaging(device, max_tokens=CAPACITY, max_reqs=4, max_blocks_per_req=1, copy=True,
                          double_buffered=True)
    if staged:
        k_step.use_staging(staging)
    t_step = StepLoRA()
    k_slots = LoRASlots(k_step, SLOTS, RANK, D_IN, SUBS, torch.float32, device)
    t_slots = LoRASlots(t_step, SLOTS, RANK, D_IN, SUBS, torch.float32, device)
    assert k_slots.b.shape == t_slots.b.shape == (SLOTS, RANK, 20)  # the same layout on both paths
    for s in range(SLOTS):
        a, b = _adapter(gen)
        k_slots.load(s, a.to(device), b.to(device))
        t_slots.load(s, a.to(device), b.to(device))
    addresses = (k_step.mapping_buffer.data_ptr(), k_slots.a.data_ptr(), k_slots.b.data_ptr())
    steps = [
        [0, -1, 2, 2, 1, 0, -1, 2, 1],  # mixed, grouped on the torch path
        [1, 1, 1, 1, 1, -1, 1],  # slot 1 beside base tokens (one-hot over two slots)
        [0, -1, 0, 0, -1],  # slot 0 beside base tokens (one-hot, one slot: base rows masked)
        [2, 2, 2],  # every token on one slot
        [-1, -1],  # no adapter: the kernels still launch, with zero counts
        "swap",  # a new adapter copied into slot 1
        [2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],  # uneven (one-hot over three slots)
    ]
    for token_slots in steps:
        if token_slots == "swap":
            a, b = _adapter(gen)
            k_slots.load(1, a.to(device), b.to(device))
            t_slots.load(1, a.to(device), b.to(device))
            continue
        slots_np = np.array(token_slots)
        staging.begin_step()
        copies = staging.num_copies
        k_step.plan(slots_np, torch.float32, device)
        assert staging.num_copies == copies + staged
        staging.end_step()
        t_step.plan(slots_np, torch.float32, device)
        x = torch.randn(len(token_slots), D_IN, generator=gen).to(device)
        base = torch.randn(len(token_slots), sum(SUBS), generator=gen).to(device)
        launches = lora_shrink._kernel.launches, lora_expand._kernel.launches
        got = k_slots(x, base.clone())
        assert (lora_shrink._kernel.launches, lora_expand._kernel.launches) == (launches[0] + 1, launches[1] + 1)
        want = t_slots(x, base.clone())
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        base_rows = torch.from_numpy(slots_np < 0).to(device)
        assert torch.equal(got[base_rows], base[base_rows])
        if (slots_np >= 0).any():
            assert not torch.allclose(got[~base_rows], base[~base_rows])
        assert (k_step.mapping_buffer.data_ptr(), k_slots.a.data_ptr(), k_slots.b.data_ptr()) == addresses
    k_step.set(None)  # a step without adapters zeroes the counts in place
    assert k_step.mapping.counts.tolist() == [0] * SLOTS
    assert k_step.mapping_buffer.data_ptr() == addresses[0]


def test_path_is_chosen_by_device() -> None:
    assert not kernels_wanted(torch.device("cpu"))
    assert kernels_wanted(torch.device("cuda")) == HAS_TRITON
    with pytest.raises(ValueError, match="capacity"):
        StepLoRA(kernels=True, slots=2, capacity=0)
