"""The mixture-of-experts feed-forward block: a router and a bank of experts held as stacked tensors.

`SparseMoeBlock(x [T, H]) -> [T, H]`: router logits (a replicated linear), top-k routing as the
architecture defines it (`route`), then `FusedMoE`, the experts:

- weights stacked per expert at load: `w13_weight` [E_local, 2 * I_shard, H] (gate rows, then up rows),
  `w2_weight` [E_local, H, I_shard], and with `bias` `w13_bias` [E_local, 2 * I_shard], `w2_bias`
  [E_local, H]. A checkpoint's per-expert tensors (`experts.{e}.gate_proj.weight`, ...) or gpt-oss's
  fused ones (`experts.gate_up_proj` [E, H, 2I], gate/up columns interleaved) are copied in by
  `FusedMoE.weight_loader`, which takes the full tensor and keeps this rank's part.
- tensor parallelism (the default with TP > 1) shards every expert's intermediate dim as the dense MLP
  does (gate/up by rows, down by columns); expert parallelism (`expert_parallel`) keeps whole experts,
  E / tp_size of them per rank (rank r holds experts [r * E_local, (r + 1) * E_local)), and routes the
  others to -1 (`expert_map`). Either way every rank sees every token (attention is TP-replicated) and
  produces a partial sum of each token's expert outputs; one all-reduce completes it. The down bias is
  added once: by rank 0 under TP, by the expert's owner under EP.
- the compute (`fused_experts(x, w13, w2, weights, ids, ...)`, kernels/fused_moe_ref.py's signature):
  the Triton grouped-GEMM kernel on CUDA (and under TRITON_INTERPRET with the Triton backend), the CPU
  fast path on CPU (engine_svc/model/layers/moe_cpu.py), the torch reference otherwise.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine_svc.distributed import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce
from engine_svc.model.layers import moe_cpu
from engine_svc.model.layers.linear import ReplicatedLinear, make_param
from engine_svc.model.moe_config import MoeSpec
from kernels import fused_moe as triton_moe  # importing kernels never imports triton
from kernels._triton import HAS_TRITON
from kernels.fused_moe_ref import fused_experts as reference_experts


def route(logits: torch.Tensor, spec: MoeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 weights [T, K], int64 expert ids [T, K]) from router logits [T, E], per `spec.scoring`."""
    if spec.scoring == "softmax_topk":
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, spec.top_k, dim=-1)
        if spec.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids
    top, ids = torch.topk(logits, spec.top_k, dim=-1)
    return torch.softmax(top, dim=-1, dtype=torch.float32), ids


def _rows(loaded: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's equal slice of dim 0."""
    rows = loaded.shape[0] // size
    return loaded.narrow(0, rank * rows, rows)


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch loading {what}: parameter {tuple(dst.shape)} vs checkpoint "
                         f"{tuple(src.shape)}")
    dst.copy_(src)


class FusedMoE(nn.Module):
    """The experts of one layer: `forward(x [T, H], weights [T, K], ids [T, K] global) -> [T, H]`,
    reduced over the TP group. `fused` (the Triton attention backend) runs the Triton kernel."""

    def __init__(self, spec: MoeSpec, hidden_size: int, dtype: torch.dtype, *, expert_parallel: bool = False,
                 fused: bool = False, tp_rank: int | None = None, tp_size: int | None = None) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank() if tp_rank is None else tp_rank
        self.tp_size = get_tp_size() if tp_size is None else tp_size
        self.spec, self.fused, self.expert_parallel = spec, fused, expert_parallel
        num_experts, size = spec.num_experts, spec.intermediate_size
        if expert_parallel:
            if num_experts % self.tp_size:
                raise ValueError(f"{num_experts} experts do not split evenly over {self.tp_size} ranks")
            self.num_local_experts, self.shard_size = num_experts // self.tp_size, size
            self.first_expert = self.tp_rank * self.num_local_experts
            local = torch.full((num_experts,), -1, dtype=torch.int64)
            local[self.first_expert : self.first_expert + self.num_local_experts] = torch.arange(
                self.num_local_experts)
            self.register_buffer("expert_map", local, persistent=False)
        else:
            if size % self.tp_size:
                raise ValueError(f"expert intermediate size {size} is not divisible by tensor-parallel size "
                                 f"{self.tp_size} (--enable-expert-parallel keeps experts whole)")
            self.num_local_experts, self.shard_size, self.first_expert = num_experts, size // self.tp_size, 0
            self.expert_map: torch.Tensor | None = None
        local_e, shard = self.num_local_experts, self.shard_size
        self.w13_weight = make_param((local_e, 2 * shard, hidden_size), dtype, self.weight_loader)
        self.w2_weight = make_param((local_e, hidden_size, shard), dtype, self.weight_loader)
        self.w13_bias = make_param((local_e, 2 * shard), dtype, self.weight_loader) if spec.expert_bias else None
        self.w2_bias = make_param((local_e, hidden_size), dtype, self.weight_loader) if spec.expert_bias else None
        self.cpu_weights: moe_cpu.CpuExperts | None = None  # the CPU layout, made at first use or by `prepack`

    # -- loading -------------------------------------------------------------------------------------

    def _local(self, expert: int) -> int | None:
        """This rank's index of global expert `expert`, None if another rank holds it."""
        local = expert - self.first_expert
        return local if 0 <= local < self.num_local_experts else None

    def _tp_rows(self, loaded: torch.Tensor) -> torch.Tensor:
        return loaded if self.expert_parallel else _rows(loaded, self.tp_rank, self.tp_size)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        """Copy this rank's part of a checkpoint tensor. shard_id: ("gate" | "up" | "down", expert) for a
        per-expert [I, H] / [H, I] tensor; "gate_up_interleaved", "gate_up_bias_interleaved", "down_t",
        "down_bias" for gpt-oss's stacked [E, H, 2I], [E, 2I], [E, I, H], [E, H] tensors."""
        if isinstance(shard_id, tuple):
            kind, expert = shard_id
            local = self._local(expert)
            if local is not None:
                self._load_expert(param.data[local], loaded, kind)
            return
        first, count = self.first_expert, self.num_local_experts
        mine = loaded.narrow(0, first, count)
        if shard_id in ("gate_up_interleaved", "gate_up_bias_interleaved"):
            if shard_id == "gate_up_interleaved":
                mine = mine.transpose(1, 2)  # [E, 2I, H], rows still interleaved
            for local in range(count):
                self._load_expert(param.data[local], mine[local, 0::2], "gate")
                self._load_expert(param.data[local], mine[local, 1::2], "up")
        elif shard_id == "down_t":
            for local in range(count):
                self._load_expert(param.data[local], mine[local].t(), "down")
        elif shard_id == "down_bias":
            _copy(param.data, mine, "experts' down_proj_bias")
        else:
            raise ValueError(f"FusedMoE: unknown shard_id {shard_id!r}")

    def _load_expert(self, dst: torch.Tensor, loaded: torch.Tensor, kind: str) -> None:
        shard = self.shard_size
        if kind == "gate":
            _copy(dst.narrow(0, 0, shard), self._tp_rows(loaded), "an expert's gate_proj")
        elif kind == "up":
            _copy(dst.narrow(0, shard, shard), self._tp_rows(loaded), "an expert's up_proj")
        elif kind == "down":
            cols = loaded if self.expert_parallel else loaded.narrow(1, self.tp_rank * shard, shard)
            _copy(dst, cols, "an expert's down_proj")
        else:
            raise ValueError(f"FusedMoE: unknown expert tensor kind {kind!r}")

    # -- compute -------------------------------------------------------------------------------------

    def prepack(self) -> None:
        """Lay the experts out for the CPU (called by cpu_gemm.prepack_linears after loading, before the
        first step): the stacked weights as they are where the native op is built (it reads them), else
        every expert's weights packed for oneDNN, the stacked copies dropped. A layer that runs the Triton
        kernel (`fused`, e.g. under TRITON_INTERPRET on CPU) keeps its stacked weights."""
        if self.fused:
            return
        if moe_cpu.native() is not None:
            self.cpu_weights = moe_cpu.CpuExperts.from_stacked(self.w13_weight.data, self.w2_weight.data)
            return
        self.cpu_weights = moe_cpu.CpuExperts.from_stacked(self.w13_weight, self.w2_weight, pack=True)
        for name in ("w13_weight", "w2_weight"):
            old = getattr(self, name)
            setattr(self, name, nn.Parameter(torch.empty(0, dtype=old.dtype), requires_grad=False))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.expert_map is not None:
            ids = self.expert_map[ids]
        add_down_bias = self.expert_parallel or self.tp_rank == 0
        spec = self.spec
        kwargs = dict(activation=spec.activation, w13_bias=self.w13_bias,
                      w2_bias=self.w2_bias if add_down_bias else None,
                      swiglu_alpha=spec.swiglu_alpha, swiglu_limit=spec.swiglu_limit)
        if (x.is_cuda and HAS_TRITON) or self.fused:
            out = triton_moe.fused_experts(x, self.w13_weight, self.w2_weight, weights, ids, **kwargs)
        elif x.device.type == "cpu":
            if self.cpu_weights is None:
                self.cpu_weights = moe_cpu.CpuExperts.from_stacked(self.w13_weight.data, self.w2_weight.data)
            out = self.cpu_weights(x, weights, ids, **kwargs)
        else:
            out = reference_experts(x, self.w13_weight, self.w2_weight, weights, ids, **kwargs)
        return tensor_model_parallel_all_reduce(out) if self.tp_size > 1 else out


class SparseMoeBlock(nn.Module):
    """Router + experts of one decoder layer. Parameters live at `gate.weight` (+ `gate.bias`) and
    `experts.*`; `checkpoint_shards` names the checkpoint tensors each of them is loaded from, in the
    layout of the architecture (`names`, see `CHECKPOINT_LAYOUTS`)."""

    def __init__(self, spec: MoeSpec, hidden_size: int, dtype: torch.dtype, names: str, *,
                 expert_parallel: bool = False, fused: bool = False) -> None:
        super().__init__()
        if names not in CHECKPOINT_LAYOUTS:
            raise ValueError(f"unknown MoE checkpoint layout {names!r}")
        self.spec, self.names = spec, names
        self.gate = ReplicatedLinear(hidden_size, spec.num_experts, spec.expert_bias, dtype)
        self.experts = FusedMoE(spec, hidden_size, dtype, expert_parallel=expert_parallel, fused=fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.spec)
        out: torch.Tensor = self.experts(x, weights, ids)
        return out

    def checkpoint_shards(self, prefix: str, param: str) -> list[tuple[str, Any]]:
        """[(checkpoint tensor name, shard_id)] that fill parameter `param` (relative to this block, which
        sits at `prefix` in the model)."""
        layout = CHECKPOINT_LAYOUTS[self.names]
        base = prefix.rsplit(".", 1)[0] + "." + str(layout["block"])
        if param.startswith("gate."):
            return [(f"{base}.{layout['router']}.{param.removeprefix('gate.')}", None)]
        per_expert: dict[str, Any] = layout["per_expert"]
        if per_expert:
            kinds = {"experts.w13_weight": ("gate", "up"), "experts.w2_weight": ("down",)}[param]
            return [(f"{base}.experts.{e}.{per_expert[kind]}.weight", (kind, e))
                    for e in range(self.spec.num_experts) for kind in kinds]
        fused: dict[str, str] = layout["fused"]
        name, shard = fused[param].split(":")
        return [(f"{base}.experts.{name}", shard)]


# Where each architecture keeps its MoE tensors: the block's module name, the router's, and either the
# per-expert module names (gate / up / down) or gpt-oss's stacked tensors (parameter -> "name:shard_id").
CHECKPOINT_LAYOUTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"block": "mlp", "router": "gate",
                  "per_expert": {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}},
    "mixtral": {"block": "block_sparse_moe", "router": "gate", "per_expert": {"gate": "w1", "up": "w3", "down": "w2"}},
    "gpt_oss": {"block": "mlp", "router": "router", "per_expert": None, "fused": {
        "experts.w13_weight": "gate_up_proj:gate_up_interleaved",
        "experts.w13_bias": "gate_up_proj_bias:gate_up_bias_interleaved",
        "experts.w2_weight": "down_proj:down_t", "experts.w2_bias": "down_proj_bias:down_bias"}},
}
