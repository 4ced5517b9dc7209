"""The tensor-parallel group and the pipeline stage of this process.

Ranks: a world of `tp * pp` processes; global rank `r` is TP rank `r % tp` of pipeline stage `r // tp`.
Each stage's TP ranks form one group (its collectives); a rank hands activations to the same TP rank
of the next stage (engine_svc/distributed/pipeline.py).

Invariant: until `init_tp_group` is called the process is rank 0 of a group of size 1, the only stage,
and every collective is the identity, so single-process code never touches torch.distributed.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from engine_svc.distributed.pipeline import StageLinks, stage_layer_range

STORE_TIMEOUT_S = 600  # how long a rank waits for the others at the rendezvous
_TP_RANK = 0
_TP_SIZE = 1
_TP_GROUP: dist.ProcessGroup | None = None
_TP_SRC = 0  # global rank of this group's TP rank 0
_PP_RANK = 0
_PP_SIZE = 1
_LINKS = StageLinks(prev_rank=None, next_rank=None)
_PARTITION: str | None = None


def init_tp_group(rank: int, size: int, backend: str = "gloo", init_method: str | None = None,
                  pipeline_stages: int = 1, layer_partition: str | None = None) -> None:
    """Join a world of `size * pipeline_stages` processes as global rank `rank`: TP rank `rank % size`
    of stage `rank // size` (initialises torch.distributed if the world has more than one process).
    `layer_partition`: --pp-layer-partition, read by `pp_layer_range` when the model is built."""
    global _TP_RANK, _TP_SIZE, _TP_GROUP, _TP_SRC, _PP_RANK, _PP_SIZE, _LINKS, _PARTITION
    world = size * pipeline_stages
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside [0, {world})")
    stage, tp_rank = divmod(rank, size)
    if world > 1 and not dist.is_initialized():
        _init_world(backend, init_method, rank, world)
    if size > 1:
        if pipeline_stages == 1:
            _TP_GROUP = dist.group.WORLD
        else:
            for s in range(pipeline_stages):  # every rank creates every group, in the same order
                group = dist.new_group(list(range(s * size, (s + 1) * size)))
                if s == stage:
                    _TP_GROUP = group
    _TP_RANK, _TP_SIZE, _TP_SRC = tp_rank, size, stage * size
    _PP_RANK, _PP_SIZE, _PARTITION = stage, pipeline_stages, layer_partition
    _LINKS = StageLinks(prev_rank=rank - size if stage > 0 else None,
                        next_rank=rank + size if stage < pipeline_stages - 1 else None)


STORE_SCHEME = "store://"


def _init_world(backend: str, init_method: str | None, rank: int, world: int) -> None:
    """torch.distributed's default group. `store://HOST:PORT` joins a TCPStore a parent process already
    serves (it bound the port, so no other socket can take it between picking and binding);
    any other `init_method` goes to torch as is (tcp://, env://: rank 0 serves the store)."""
    if init_method is None or not init_method.startswith(STORE_SCHEME):
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
        return
    host, _, port = init_method.removeprefix(STORE_SCHEME).rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)


def serve_store(host: str = "127.0.0.1") -> tuple[Any, str]:
    """A TCPStore served by this process on a port the OS picks, and the `init_method` its children join
    it with. The store lives as long as the returned object is referenced."""
    store = dist.TCPStore(host, 0, None, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=STORE_TIMEOUT_S))
    return store, f"{STORE_SCHEME}{host}:{store.port}"


def destroy_tp_group() -> None:
    """Leave the groups and return to the single-process state."""
    global _TP_RANK, _TP_SIZE, _TP_GROUP, _TP_SRC, _PP_RANK, _PP_SIZE, _LINKS, _PARTITION
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP_RANK, _TP_SIZE, _TP_GROUP, _TP_SRC = 0, 1, None, 0
    _PP_RANK, _PP_SIZE, _LINKS, _PARTITION = 0, 1, StageLinks(prev_rank=None, next_rank=None), None


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def get_pp_rank() -> int:
    """This process's pipeline stage (0 = the first, with the embedding)."""
    return _PP_RANK


def get_pp_size() -> int:
    return _PP_SIZE


def pp_layer_range(num_layers: int) -> tuple[int, int]:
    """[start, end) of the model layers this process's stage owns (all of them with one stage)."""
    return stage_layer_range(num_layers, _PP_RANK, _PP_SIZE, _PARTITION)


def stage_links() -> StageLinks:
    """Send/receive to the neighbouring stages (both ends None with one stage)."""
    return _LINKS


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
    """Overwrite `x` on every rank of the TP group with TP rank `src`'s (in place); identity without a group."""
    if _TP_GROUP is None:
        return x
    dist.broadcast(x, src=_TP_SRC + src, group=_TP_GROUP)
    return x
