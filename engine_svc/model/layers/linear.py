"""Tensor-parallel linear layers.

Each layer holds only this rank's shard. Every parameter carries
`weight_loader(param, loaded_weight, shard_id=None)`, which takes the *full* checkpoint tensor and
copies this rank's slice of it into `param`:

- ColumnParallelLinear: output rows split evenly across ranks (no communication).
- MergedColumnParallelLinear: several column-parallel outputs (e.g. gate and up) fused into one
  matmul; `shard_id` is the index of the sub-output; each sub-output is split across ranks.
- QKVParallelLinear: q, k, v fused into one matmul (`shard_id` "q" | "k" | "v"). Query heads are
  split across ranks; KV heads too, or replicated when there are fewer KV heads than ranks.
- RowParallelLinear: input columns split across ranks; partial outputs are summed by all-reduce.
- ReplicatedLinear: the whole weight on every rank (e.g. a MoE router, whose every output each rank needs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine_svc.distributed import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce
from engine_svc.model.layers.cpu_gemm import PackedWeight, packed_linear

# weight_loader(param, full checkpoint tensor, shard_id): copies this rank's slice into param.
WeightLoader = Callable[[torch.Tensor, torch.Tensor, Any], None]


def _divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by tensor-parallel size {denominator}")
    return numerator // denominator


def make_param(shape: Sequence[int], dtype: torch.dtype | None, loader: WeightLoader) -> nn.Parameter:
    """An inference-only parameter (no autograd) carrying `loader` as its `weight_loader`."""
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def copy_full(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
    """Loader for a replicated parameter: the checkpoint tensor is copied whole."""
    if param.shape != loaded.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}"
        )
    param.data.copy_(loaded)


def _copy_rows(dst: torch.Tensor, loaded: torch.Tensor, start: int) -> None:
    """Copy loaded[start : start + len(dst)] (dim 0) into dst, checking trailing dims."""
    src = loaded.narrow(0, start, dst.shape[0])
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch: shard {tuple(dst.shape)} vs checkpoint slice {tuple(src.shape)}")
    dst.copy_(src)


class _TPLinear(PackedWeight):
    """Shared plumbing: rank/size resolution and a [out, in] weight plus optional bias.

    After `cpu_gemm.prepack_linears` the weight lives packed for oneDNN in `packed` (see cpu_gemm.py).
    `lora` (engine_svc/lora/slots.py), when set, adds each token's adapter delta to the matmul's output."""

    lora: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        params_dtype: torch.dtype | None,
        tp_rank: int | None,
        tp_size: int | None,
        bias_loader: WeightLoader | None = None,
    ) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank() if tp_rank is None else tp_rank
        self.tp_size = get_tp_size() if tp_size is None else tp_size
        self.in_features, self.out_features = in_features, out_features
        self.weight = make_param((out_features, in_features), params_dtype, self.weight_loader)
        self.bias = (
            make_param((out_features,), params_dtype, bias_loader or self.weight_loader) if bias else None
        )

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        raise NotImplementedError

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T + bias, through the packed weight when there is one."""
        if self.packed is not None:
            return packed_linear(x, self.packed, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x, self.bias)
        return out if self.lora is None else self.lora(x, out)


class ReplicatedLinear(_TPLinear):
    """y = x W^T + b with the whole W on every rank (no communication)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__(input_size, output_size, bias, params_dtype, 0, 1)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        copy_full(param, loaded)


class ColumnParallelLinear(_TPLinear):
    """y = x W^T + b with W's rows (outputs) split across ranks; the output stays sharded."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        size = get_tp_size() if tp_size is None else tp_size
        super().__init__(input_size, _divide(output_size, size), bias, params_dtype, tp_rank, tp_size)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        rows = param.shape[0]
        _copy_rows(param.data, loaded, self.tp_rank * rows)


class MergedColumnParallelLinear(_TPLinear):
    """Several column-parallel outputs in one matmul: this rank's slice of each, concatenated."""

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        size = get_tp_size() if tp_size is None else tp_size
        self.shard_sizes = [_divide(n, size) for n in output_sizes]
        super().__init__(input_size, sum(self.shard_sizes), bias, params_dtype, tp_rank, tp_size)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        if not isinstance(shard_id, int):
            raise ValueError(f"MergedColumnParallelLinear needs an int shard_id, got {shard_id!r}")
        rows = self.shard_sizes[shard_id]
        offset = sum(self.shard_sizes[:shard_id])
        _copy_rows(param.data.narrow(0, offset, rows), loaded, self.tp_rank * rows)


class QKVParallelLinear(_TPLinear):
    """q, k and v projections in one matmul. Output per rank: [q heads | k heads | v heads] x head_size.

    With fewer KV heads than ranks, each KV head is replicated on tp_size / total_num_kv_heads ranks.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        size = get_tp_size() if tp_size is None else tp_size
        self.head_size = head_size
        self.num_heads = _divide(total_num_heads, size)
        if size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.kv_replicas = _divide(size, total_num_kv_heads)
        else:
            self.num_kv_heads = _divide(total_num_kv_heads, size)
            self.kv_replicas = 1
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias, params_dtype, tp_rank, tp_size)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        if shard_id == "q":
            offset, rows, start = 0, self.q_size, self.tp_rank * self.q_size
        elif shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            rows, start = self.kv_size, (self.tp_rank // self.kv_replicas) * self.kv_size
        else:
            raise ValueError(f"QKVParallelLinear shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        _copy_rows(param.data.narrow(0, offset, rows), loaded, start)


class RowParallelLinear(_TPLinear):
    """y = x W^T + b with W's columns (inputs) split across ranks; partial sums are all-reduced.

    The input must already be sharded along its last dim (the output of a column-parallel layer).
    The bias is replicated; only rank 0 adds it, so the reduced sum contains it once.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        reduce_results: bool = True,
    ) -> None:
        size = get_tp_size() if tp_size is None else tp_size
        super().__init__(
            _divide(input_size, size),
            output_size,
            bias,
            params_dtype,
            tp_rank,
            tp_size,
            bias_loader=copy_full,
        )
        self.reduce_results = reduce_results

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        cols = param.shape[1]
        src = loaded.narrow(1, self.tp_rank * cols, cols)
        if param.shape != src.shape:
            raise ValueError(
                f"shape mismatch: shard {tuple(param.shape)} vs checkpoint slice {tuple(src.shape)}"
            )
        param.data.copy_(src)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(x)
        # Only rank 0 adds the bias, so the sum over ranks contains it exactly once; a LoRA delta of this
        # rank's input columns is a partial sum too.
        out = self.matmul(x, self.bias if self.tp_rank == 0 else None)
        if self.lora is not None:
            out = self.lora(x, out)
        return tensor_model_parallel_all_reduce(out) if self.reduce_results else out
