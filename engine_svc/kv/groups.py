"""KV-cache groups of a hybrid model: its attention layers grouped by attention type (torch-free).

A hybrid model (gpt-oss, Qwen2/Qwen3 whose `layer_types` mix sliding and full attention) has layers that
read different parts of the context: a full layer every key, a sliding layer only its window's. With one
block table per request for all layers no block could go back before the request ends. As vLLM's hybrid
allocator does, the layers are split into groups of one attention type each (full, or one window W);
each group has its own block table per request over one shared pool, so a sliding group gives back the
blocks behind its window while a full group keeps them (engine_svc/kv/hybrid_manager.py).

Invariants:
- Every group has the same number of layers, `layers_per_group`: the greatest common divisor of the
  attention types' layer counts (2 full + 10 sliding: groups of 2, one full group and five sliding
  ones; as many of each kind: two groups). No group is padded, so a pool block of any group holds the
  same bytes (vLLM's equal page sizes) and no layer's memory is wasted.
- Group order: the full groups first, then the sliding ones by window, smallest first; within a type the
  layers go to its groups in layer order, `layers_per_group` at a time. `windows[g]` is group g's window
  (None: full attention).
- No groups (None) when the layers need only one table: no layer slides, or every layer slides over
  the same window (engine_svc/kv/kv_cache_manager.py frees behind it).
- Storage: layer i reads and writes cache tensor `layer_slot[i]` (its index within its group), so the
  j-th layer of each group share one tensor, and a block id names one block of `layers_per_group`
  tensors: a pool block holds one group's K/V for one block of positions. The pool thus has
  `num_groups` times as many blocks as a one-table cache of the same memory.
- Tables reach the workers interleaved: entry `i * num_groups + g` of a request's row is group g's
  block for positions [i * block_size, (i + 1) * block_size). Every group's table has one entry per
  block of positions (freed ones stay as placeholders), so the groups' tables grow together.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int | None, ...]  # group g's sliding window, None: full attention
    layer_group: tuple[int, ...]  # layer i's group
    layer_slot: tuple[int, ...]  # layer i's index within its group: the cache tensor it uses

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def layers_per_group(self) -> int:
        return len(self.layer_group) // self.num_groups


def _type_order(window: int | None) -> tuple[int, int]:
    return (0, 0) if window is None else (1, window)


def hybrid_groups(layer_windows: tuple[int | None, ...] | None) -> KVGroups | None:
    """The KV groups of a model whose layers have these windows (None: full attention), or None when
    the layers share one table: no window, or one window for every layer (see the module docstring)."""
    if not layer_windows:
        return None
    kinds = sorted(set(layer_windows), key=_type_order)
    if len(kinds) == 1:
        return None
    by_kind = {kind: [i for i, w in enumerate(layer_windows) if w == kind] for kind in kinds}
    size = 0
    for layers in by_kind.values():
        size = gcd(size, len(layers))
    windows: list[int | None] = []
    group, slot = [0] * len(layer_windows), [0] * len(layer_windows)
    for kind in kinds:
        layers = by_kind[kind]
        for start in range(0, len(layers), size):
            for j, i in enumerate(layers[start : start + size]):
                group[i], slot[i] = len(windows), j
            windows.append(kind)
    return KVGroups(tuple(windows), tuple(group), tuple(slot))
