"""KV-cache groups of a hybrid model: its attention layers grouped by attention type (torch-free).

A hybrid model (gpt-oss, Qwen2/Qwen3 whose `layer_types` mix sliding and full attention) has layers that
read different parts of the context: a full layer every key, a sliding layer only its window's. With one
block table per request for all layers no block could go back before the request ends. As vLLM's hybrid
allocator does, the layers are grouped by attention type; each group has its own block table per request
over one shared pool, so the sliding group gives back the blocks behind its window while the full group
keeps them (engine_svc/kv/hybrid_manager.py).

Invariants:
- Exactly two groups, the full-attention layers' (group 0) and the sliding layers' (group 1, one window
  W), with as many layers each. Other mixes (unequal counts, two different windows) get no groups: every
  layer then shares one table that keeps every block.
- Storage: layer i reads and writes cache tensor `layer_slot[i]` (its index within its group), so the
  j-th layer of each group share one tensor, and a block id names one block of `layers_per_group`
  tensors: a pool block holds one group's K/V for one block of positions, as vLLM's equal page sizes do.
  The pool thus has `num_groups` times as many blocks as a one-table cache of the same memory.
- Tables reach the workers interleaved: entry `i * num_groups + g` of a request's row is group g's
  block for positions [i * block_size, (i + 1) * block_size). Every group's table has one entry per
  block of positions (freed ones stay as placeholders), so the groups' tables grow together.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int | None, ...]  # group g's sliding window, None: full attention (group 0)
    layer_group: tuple[int, ...]  # layer i's group
    layer_slot: tuple[int, ...]  # layer i's index within its group: the cache tensor it uses

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def layers_per_group(self) -> int:
        return len(self.layer_group) // self.num_groups


def hybrid_groups(layer_windows: tuple[int | None, ...] | None) -> KVGroups | None:
    """The KV groups of a model whose layers have these windows (None: full attention), or None when
    the layers share one table: no window, one window for every layer (engine_svc/kv/kv_cache_manager.py
    frees behind it), or a mix this grouping does not cover (see the module docstring)."""
    if not layer_windows:
        return None
    kinds = set(layer_windows)
    if len(kinds) != 2 or None not in kinds:
        return None
    window = next(w for w in kinds if w is not None)
    full = [i for i, w in enumerate(layer_windows) if w is None]
    sliding = [i for i, w in enumerate(layer_windows) if w is not None]
    if len(full) != len(sliding):
        return None
    group, slot = [0] * len(layer_windows), [0] * len(layer_windows)
    for g, layers in enumerate((full, sliding)):
        for j, i in enumerate(layers):
            group[i], slot[i] = g, j
    return KVGroups((None, window), tuple(group), tuple(slot))
