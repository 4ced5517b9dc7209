"""The tensor-parallel group of this process.

Invariant: until `init_tp_group` is called the process is rank 0 of a group of size 1 and every
collective is the identity, so single-process code never touches torch.distributed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_TP_RANK = 0
_TP_SIZE = 1
_TP_GROUP: dist.ProcessGroup | None = None


def init_tp_group(rank: int, size: int, backend: str = "gloo", init_method: str | None = None) -> None:
    """Join a TP group of `size` processes as `rank` (initialises torch.distributed if needed)."""
    global _TP_RANK, _TP_SIZE, _TP_GROUP
    if not 0 <= rank < size:
        raise ValueError(f"tp rank {rank} is outside [0, {size})")
    if size > 1:
        if not dist.is_initialized():
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size)
        _TP_GROUP = dist.group.WORLD
    _TP_RANK, _TP_SIZE = rank, size


def destroy_tp_group() -> None:
    """Leave the TP group and return to the single-process state."""
    global _TP_RANK, _TP_SIZE, _TP_GROUP
    if _TP_GROUP is not None and dist.is_initialized():
        dist.destroy_process_group()
    _TP_RANK, _TP_SIZE, _TP_GROUP = 0, 1, None


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the TP group (in place when distributed); identity without a group."""
    if _TP_GROUP is None:
        return x
    dist.all_reduce(x, group=_TP_GROUP)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order; identity without a group."""
    if _TP_GROUP is None:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=dim)


def tensor_model_parallel_broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Overwrite `x` on every rank with rank `src`'s (in place); identity without a group."""
    if _TP_GROUP is None:
        return x
    dist.broadcast(x, src=src, group=_TP_GROUP)
    return x
