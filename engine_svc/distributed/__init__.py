"""Tensor-parallel process-group state and collectives (identity at TP = 1)."""

from engine_svc.distributed.parallel_state import (
    destroy_tp_group,
    get_tp_rank,
    get_tp_size,
    init_tp_group,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
    tensor_model_parallel_broadcast,
)

__all__ = [
    "destroy_tp_group",
    "get_tp_rank",
    "get_tp_size",
    "init_tp_group",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
    "tensor_model_parallel_broadcast",
]
