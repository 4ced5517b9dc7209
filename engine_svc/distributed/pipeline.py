"""Pipeline stages: which layers a stage owns, and the hand-off of activations from stage to stage.

Layer partition (vLLM's rule): `num_layers // stages` layers per stage; the remainder goes one layer
each to the stages just before the last, walking backwards (the last stage also runs the norm, the LM
head and the sampler). `--pp-layer-partition "a,b,..."` overrides it: one positive count per stage,
summing to the model's layers.

Hand-off: a stage that is not the last sends its output, the hidden states and the residual stream
(both [num_tokens, hidden]), to the same TP rank of the next stage; the receiver knows the shape from
the step it runs (every rank runs every step, in the same order), so only the data travels. Sends are
asynchronous (`isend`): a stage starts its next step while the previous hand-off is still on the wire,
which is what lets stages overlap; a send is waited for before the next one is posted, so at most one
hand-off per stage is in flight and sends arrive in step order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


def partition_layers(num_layers: int, stages: int, override: str | None = None) -> list[int]:
    """Layers per stage. ValueError naming the flag when the override does not fit the model."""
    if stages < 1:
        raise ValueError(f"--pipeline-parallel-size must be >= 1, got {stages}")
    if override:
        try:
            counts = [int(part) for part in override.split(",")]
        except ValueError:
            raise ValueError(f"--pp-layer-partition {override!r} must be comma-separated integers") from None
        if len(counts) != stages:
            raise ValueError(f"--pp-layer-partition {override!r} has {len(counts)} entries; "
                             f"--pipeline-parallel-size is {stages}")
        if sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(f"--pp-layer-partition {override!r} must give every stage at least one layer "
                             f"and sum to the model's {num_layers} layers")
        return counts
    if num_layers < stages:
        raise ValueError(f"--pipeline-parallel-size {stages} exceeds the model's {num_layers} layers")
    counts = [num_layers // stages] * stages
    for i in range(2, num_layers % stages + 2):
        counts[-i] += 1
    return counts


def stage_layer_range(num_layers: int, stage: int, stages: int, override: str | None = None) -> tuple[int, int]:
    """[start, end) of the layers stage `stage` owns."""
    counts = partition_layers(num_layers, stages, override)
    start = sum(counts[:stage])
    return start, start + counts[stage]


@dataclass
class StageLinks:
    """This rank's peers in the neighbouring stages (global ranks; None at the ends of the pipeline)."""

    prev_rank: int | None
    next_rank: int | None
    _pending: list[tuple[dist.Work, torch.Tensor]] | None = None

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """Post the hand-off of one step to the next stage (waits for the previous one first)."""
        assert self.next_rank is not None, "the last stage sends nothing"
        self.wait_sent()
        pending = []
        for t in (hidden.contiguous(), residual.contiguous()):  # kept alive until the send completes
            work = dist.isend(t, dst=self.next_rank)
            if work is not None:
                pending.append((work, t))
        self._pending = pending

    def wait_sent(self) -> None:
        """Block until the last hand-off posted has left (its tensors may then be freed)."""
        for work, _ in self._pending or ():
            work.wait()
        self._pending = None

    def recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's (hidden, residual) for a step of `num_tokens` tokens (blocks until here)."""
        assert self.prev_rank is not None, "the first stage receives nothing"
        hidden = torch.empty((num_tokens, hidden_size), dtype=dtype, device=device)
        residual = torch.empty_like(hidden)
        dist.recv(hidden, src=self.prev_rank)
        dist.recv(residual, src=self.prev_rank)
        return hidden, residual
