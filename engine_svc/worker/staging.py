"""One host -> device staging path for a worker: every step input, CUDA-graph replays and sampling metadata.

`StepStaging` owns persistent buffer pairs (`Twin`): a host array (pinned on CUDA) and a device tensor of
the same shape, allocated once. The host writes a step's values into the host arrays and sends them up
with asynchronous copies; the model reads the device tensors. The same pairs serve eager steps and CUDA
graph replays (a graph captured the device tensors' addresses, which never change: their capacity is
fixed at construction, for the largest step the scheduler can build), and the sampler's parameters
(`sample/columns.py`) and per-step arrays (`stage_arrays`) go through pairs of the same object.

Safety without syncs (on CUDA):
- device side: a device tensor is rewritten only by a copy queued after every kernel of the previous step
  that read it, so stream order protects it;
- host side: `begin_step` waits for an event recorded by `end_step` after the previous step's last copy,
  so no pinned array is rewritten while a copy from it may still be running (long finished in practice:
  each step ends by reading the sampled tokens back). One event covers every pair.
- `double_buffered` (async scheduling, where a step does not end by reading its tokens back): each pair
  has two host arrays, used by alternate steps, and one event per set; `begin_step` switches sets and
  waits for the step before the previous one, so the host writes step N+1's inputs while step N's
  copies and kernels (queued after them) still run. Every value a step uploads is written by that step
  (or, for block-table columns past a row's blocks, never read), so alternating sets is invisible.

On a CPU device the host array and the device tensor are one tensor (nothing is copied), unless
`copy=True`, which runs the copying logic with two CPU tensors so that tests can check it without a GPU
(`num_copies` counts the copies issued).

`stage_inputs(..., fill=f)` calls `f(device input ids)` once they are staged, before the model reads them:
async scheduling writes the previous step's sampled ids there (engine_svc/worker/sampled_feed.py).

Inputs of a step (`stage_inputs`): token ids, positions and slots (one row per hybrid KV group,
engine_svc/kv/groups.py; one without groups) share one [2 + G, max_tokens] int64 pair sent
whole (one copy; a strided prefix would go through an unpinned temporary); query_start_loc, seq_lens, the
block table (whole rows of the served max_model_len's width) and the sampled rows go up as prefixes. For a
graph replay (`pad_to`) rows n..B-1 become dummy requests in place: token 0 at position 0, slot PAD_SLOT
(the KV write kernel skips negative slots), seq_len 1, block 0; query_start_loc continues 0, 1, .., B.
Block-table columns past a row's ceil(seq_len / block_size) blocks keep what an earlier step left there:
attention never reads them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine_svc.attention.backend import AttentionMetadata, with_kv_groups
from engine_svc.worker.input_batch import StepInputs

PAD_SLOT = -1  # the KV write kernel skips negative slots


class Twin:
    """A host array and its device twin of one shape and dtype (the same tensor on CPU without copying).
    Double-buffered staging gives it two host arrays; `host` / `host_tensor` are the current step's."""

    def __init__(self, staging: StepStaging, shape: tuple[int, ...], dtype: torch.dtype, fill: int = 0) -> None:
        self._staging = staging
        self._hosts = [torch.full(shape, fill, dtype=dtype, pin_memory=staging.pinned)
                       for _ in range(2 if staging.double_buffered else 1)]
        self._arrays = [h.numpy() for h in self._hosts]
        host = self._hosts[staging.buffer if staging.double_buffered else 0]
        self.host_tensor = host
        self.host: np.ndarray = host.numpy()
        self.device = host.to(staging.device, copy=True) if staging.copy else host

    def use(self, buffer: int) -> None:
        """Make host array `buffer` (0 or 1) the current one (double-buffered staging only)."""
        self.host_tensor, self.host = self._hosts[buffer], self._arrays[buffer]

    def mirror(self) -> None:
        """Copy the current host array into the other one (after writing initial values)."""
        for array in self._arrays:
            if array is not self.host:
                array[...] = self.host

    def upload(self, rows: int | None = None) -> torch.Tensor:
        """Copy the first `rows` rows (all when None) up; returns the device view of them."""
        dev = self.device if rows is None else self.device[:rows]
        if self._staging.copy:
            src = self.host_tensor if rows is None else self.host_tensor[:rows]
            dev.copy_(src, non_blocking=True)
            self._staging.num_copies += 1
        return dev


@dataclass
class StagedInputs:
    """Device views of one step's inputs (valid until the next step's `stage_inputs`)."""

    input_ids: torch.Tensor  # [T] (T = the padded size for a graph replay)
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_blocks_per_req] int32
    group_slots: torch.Tensor | None = None  # [G, T]: each hybrid KV group's slots (slot_mapping is row 0)


class StepStaging:
    """The worker's staging buffers; see the module docstring. Capacities: `max_tokens` tokens a step,
    `max_reqs` requests, `max_blocks_per_req` block-table columns (the served max_model_len's)."""

    def __init__(
        self, device: torch.device, *, max_tokens: int, max_reqs: int, max_blocks_per_req: int,
        copy: bool | None = None, double_buffered: bool = False, num_groups: int = 1,
    ) -> None:
        self.device = device
        self.num_groups = num_groups
        self.copy = device.type == "cuda" if copy is None else copy
        self.pinned = device.type == "cuda"
        self.double_buffered = double_buffered and self.copy  # without copies host and device are one
        self.buffer = 0  # the current host set (double-buffered)
        self._twins: list[Twin] = []
        self.num_copies = 0
        self.max_tokens, self.max_reqs = max_tokens, max_reqs
        # Recorded after each step's last copy (one per host set when double-buffered).
        self._events = [torch.cuda.Event() if self.pinned else None for _ in range(2 if self.double_buffered else 1)]
        # Every row starts as a dummy request (see the module docstring), on the device too.
        self.tokens = self.twin((2 + num_groups, max_tokens), torch.int64)  # input ids, positions, slots
        self.tokens.host[2:].fill(PAD_SLOT)
        self.tokens.upload()
        self.query_start_loc = self.twin((max_reqs + 1,), torch.int32)
        self.query_start_loc.host[:] = np.arange(max_reqs + 1)
        self.query_start_loc.upload()
        self.seq_lens = self.twin((max_reqs,), torch.int32, fill=1)
        self.block_table = self.twin((max_reqs, max(max_blocks_per_req, 1)), torch.int32)
        self.sample_rows = self.twin((max_reqs,), torch.int64)
        self._scratch: dict[np.dtype, Twin] = {}
        self._scratch_used: dict[np.dtype, int] = {}  # elements handed out this step, per dtype
        for twin in self._twins:
            twin.mirror()
        self.num_copies = 0

    def twin(self, shape: tuple[int, ...], dtype: torch.dtype, fill: int = 0) -> Twin:
        twin = Twin(self, shape, dtype, fill)
        self._twins.append(twin)
        return twin

    # ---- step boundaries ---------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Before writing any host array: the copies of the last step that used this host set have
        finished reading them (the previous step, or with double buffering the one before it)."""
        if self.double_buffered:
            self.buffer ^= 1
            for twin in self._twins:
                twin.use(self.buffer)
        event = self._events[self.buffer]
        if event is not None:
            event.synchronize()  # returns at once before the first record()
        self._scratch_used.clear()

    def end_step(self) -> None:
        """After the step's last copy."""
        event = self._events[self.buffer]
        if event is not None:
            event.record()

    # ---- inputs ------------------------------------------------------------------------------------
    def stage_inputs(self, inputs: StepInputs, pad_to: int | None = None,
                     fill: Callable[[torch.Tensor], None] | None = None) -> StagedInputs:
        """The step's inputs on the device; `pad_to` B pads a decode-only step of n <= B requests with
        dummy requests to B rows (a CUDA-graph replay); `fill` rewrites the device input ids once staged."""
        n, num_tokens = len(inputs.req_ids), len(inputs.input_ids)
        tokens = self.tokens.host
        tokens[0, :num_tokens] = inputs.input_ids
        tokens[1, :num_tokens] = inputs.positions
        tokens[2:, :num_tokens] = inputs.slot_mapping
        self.query_start_loc.host[: n + 1] = inputs.query_start_loc
        self.seq_lens.host[:n] = inputs.seq_lens
        width = inputs.block_table.shape[1]
        self.block_table.host[:n, :width] = inputs.block_table
        rows = n
        if pad_to is not None:
            if inputs.num_decodes != n or num_tokens != n or n > pad_to:
                raise ValueError(f"padding to {pad_to} needs a decode-only step of at most {pad_to} requests")
            tokens[:2, n:pad_to] = 0
            tokens[2:, n:pad_to] = PAD_SLOT
            self.query_start_loc.host[n + 1 : pad_to + 1] = np.arange(n + 1, pad_to + 1)
            self.seq_lens.host[n:pad_to] = 1
            self.block_table.host[n:pad_to, 0] = 0
            rows = num_tokens = pad_to
        staged = self.tokens.upload()[:, :num_tokens]
        ids, positions, slots = staged[0], staged[1], staged[2]
        if fill is not None:
            fill(ids)
        return StagedInputs(ids, positions, slots, self.query_start_loc.upload(rows + 1),
                            self.seq_lens.upload(rows), self.block_table.upload(rows),
                            staged[2:] if self.num_groups > 1 else None)

    def stage_sample_rows(self, rows: np.ndarray) -> torch.Tensor:
        """Indices [n] int64 on the device (the hidden rows to sample)."""
        self.sample_rows.host[: len(rows)] = rows
        return self.sample_rows.upload(len(rows))

    def graph_metadata(self, size: int, max_seq_len: int) -> AttentionMetadata:
        """Attention metadata over the first `size` rows of the device buffers, for a graph to capture.
        Host fields are bounds / placeholders: a graph cannot see host values that change between replays
        (engine_svc/worker/cuda_graphs.py)."""
        meta = AttentionMetadata(
            slot_mapping=self.tokens.device[2, :size],
            query_start_loc=self.query_start_loc.device[: size + 1],
            seq_lens=self.seq_lens.device[:size],
            block_table=self.block_table.device[:size],
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[max_seq_len] * size,
            num_decodes=size,
        )
        if self.num_groups > 1:
            with_kv_groups(meta, self.tokens.device[2:, :size], self.num_groups)
        return meta

    # ---- variable-size arrays ------------------------------------------------------------------------
    def stage_arrays(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Device tensors with the arrays' shapes and values, packed per dtype into growable scratch pairs
        after whatever this step already staged there (one copy per dtype per call); valid until the next
        step. A pair that must grow is replaced; tensors staged earlier keep the old one alive."""
        offsets, ends = [], dict(self._scratch_used)
        for a in arrays:
            offsets.append(ends.get(a.dtype, 0))
            ends[a.dtype] = offsets[-1] + a.size
        devices = {}
        for dtype, end in ends.items():
            start = self._scratch_used.get(dtype, 0)
            if end == start:
                continue
            twin = self._scratch_twin(dtype, end)
            for a, off in zip(arrays, offsets):
                if a.dtype == dtype:
                    twin.host[off : off + a.size] = a.reshape(-1)
            devices[dtype] = twin.upload(end)
            self._scratch_used[dtype] = end
        return [devices[a.dtype][off : off + a.size].view(a.shape) if a.size else
                torch.empty(a.shape, dtype=torch.from_numpy(a).dtype, device=self.device)
                for a, off in zip(arrays, offsets)]

    def _scratch_twin(self, dtype: np.dtype, size: int) -> Twin:
        have = self._scratch.get(dtype)
        if have is None or have.host.size < size:
            capacity = max(size, 2 * (have.host.size if have is not None else 0), 1024)
            tdtype = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
            if have is not None:
                self._twins.remove(have)
            self._scratch[dtype] = self.twin((capacity,), tdtype)
        return self._scratch[dtype]
