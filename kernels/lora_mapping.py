"""The token -> adapter-slot mapping the LoRA kernels read (kernels/lora_shrink.py, kernels/lora_expand.py).

One int32 buffer of `capacity + 2 * num_slots` entries, built on the host from each token's slot (-1: the
base model, no delta) and copied to the device in one transfer:

    [0, capacity)                          sorted: the adapter tokens' indices grouped by slot, ascending
                                           within a slot (entries past the adapter tokens are 0, unread);
    [capacity, capacity + S)               count[s]: how many tokens use slot s;
    [capacity + S, capacity + 2 S)         start[s]: where slot s's tokens begin in `sorted`.

A kernel program for slot s handles `sorted[start[s] : start[s] + count[s]]`; a slot with no token costs
one program that exits at once, and base-model tokens appear nowhere, so their outputs are untouched.
The layout has a fixed size for a fixed (capacity, S), so a device copy of it can live in one buffer that
is rewritten in place every step (CUDA graphs read it by address).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch


class LoRAMapping(NamedTuple):
    """Device views of one mapping buffer (see the module docstring)."""

    sorted_tokens: torch.Tensor  # [capacity] int32
    counts: torch.Tensor  # [S] int32
    starts: torch.Tensor  # [S] int32


def mapping_size(capacity: int, num_slots: int) -> int:
    return capacity + 2 * num_slots


def build_mapping(token_slots: np.ndarray, num_slots: int, capacity: int,
                  out: np.ndarray | None = None) -> np.ndarray:
    """The int32 mapping of `token_slots` [T] (T <= capacity; each in [-1, num_slots)), written into `out`
    (a buffer of `mapping_size` entries, e.g. pinned host memory) when given."""
    tokens = len(token_slots)
    if tokens > capacity:
        raise ValueError(f"token_slots: {tokens} tokens exceed the mapping capacity {capacity}")
    if tokens and (token_slots.min() < -1 or token_slots.max() >= num_slots):
        raise ValueError(f"token_slots: slots must lie in [-1, {num_slots})")
    buf = np.zeros(mapping_size(capacity, num_slots), dtype=np.int32) if out is None else out
    adapter = np.flatnonzero(token_slots >= 0)
    slots = token_slots[adapter]
    order = adapter[np.argsort(slots, kind="stable")]
    counts = np.bincount(slots, minlength=num_slots)
    buf[: len(order)] = order
    buf[len(order) : capacity] = 0
    buf[capacity : capacity + num_slots] = counts
    buf[capacity + num_slots :] = np.cumsum(counts) - counts
    return buf


def split_mapping(buffer: torch.Tensor, capacity: int, num_slots: int) -> LoRAMapping:
    """Views of a device copy of a mapping buffer (no copy)."""
    return LoRAMapping(buffer[:capacity], buffer[capacity : capacity + num_slots],
                       buffer[capacity + num_slots : capacity + 2 * num_slots])
