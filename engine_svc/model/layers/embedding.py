"""Vocabulary-parallel token embedding and LM head.

The vocabulary is padded to a multiple of tp_size and split into equal contiguous ranges; rank r
owns token ids [r * V_rank, (r + 1) * V_rank). Padding rows are zero and their logits are dropped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_svc.distributed import (
    get_tp_rank,
    get_tp_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from engine_svc.model.layers.cpu_gemm import PackedWeight, packed_linear
from engine_svc.model.layers.linear import make_param


class VocabParallelEmbedding(nn.Module):
    """Embedding table whose rows (token ids) are split across ranks; lookups are all-reduced."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        params_dtype: torch.dtype | None = None,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank() if tp_rank is None else tp_rank
        self.tp_size = get_tp_size() if tp_size is None else tp_size
        self.num_embeddings = num_embeddings
        self.rows_per_rank = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)
        self.weight = make_param((self.rows_per_rank, embedding_dim), params_dtype, self.weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        if loaded.shape[0] != self.num_embeddings or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(
                f"shape mismatch: expected ({self.num_embeddings}, {param.shape[1]}), got {tuple(loaded.shape)}"
            )
        owned = max(self.vocab_end - self.vocab_start, 0)
        param.data[:owned].copy_(loaded[self.vocab_start : self.vocab_end])
        param.data[owned:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = (input_ids - self.vocab_start) * owned
        out = F.embedding(local_ids, self.weight) * owned.unsqueeze(-1).to(self.weight.dtype)
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding, PackedWeight):
    """Output projection sharded like the embedding; each rank's logits are all-gathered. Packed for
    oneDNN by `cpu_gemm.prepack_linears` (a tied head keeps the embedding's plain table too)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab] (full vocabulary on every rank)."""
        if self.packed is not None:
            logits = packed_linear(hidden, self.packed, None)
        else:
            logits = F.linear(hidden, self.weight)
        if self.tp_size > 1:
            logits = tensor_model_parallel_all_gather(logits, dim=-1)[:, : self.num_embeddings]
        return logits.float()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden)
