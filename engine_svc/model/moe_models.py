"""Mixture-of-experts decoders: Qwen3-MoE and Mixtral as Llama-family decoders whose feed-forward blocks
are expert blocks (engine_svc/model/layers/moe.py).

Attention, norms, embeddings and the LM head are the Llama family's (engine_svc/model/llama.py); what
differs is each layer's feed-forward, built by `MoeFeedForward` from the `MoeSpec` that
engine_svc/model/moe_config.py read (and checked) from the config: an expert block on the layers the
spec marks sparse, the dense `LlamaMLP` on the others (Qwen3-MoE's `mlp_only_layers` and
`decoder_sparse_step`).

- Qwen3-MoE: q/k RMSNorm and an explicit head_dim as Qwen3; softmax routing, top-k renormalised when
  `norm_topk_prob`; checkpoint tensors `mlp.gate.weight`, `mlp.experts.{e}.{gate,up,down}_proj.weight`.
- Mixtral: Mistral's attention; softmax routing, top-k always renormalised; checkpoint tensors
  `block_sparse_moe.gate.weight`, `block_sparse_moe.experts.{e}.w{1,3,2}.weight` (gate, up, down).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine_svc.model.layers.moe import SparseMoeBlock
from engine_svc.model.llama import DecoderVariant, LlamaMLP
from engine_svc.model.moe_config import MoeSpec, moe_spec


@dataclass(frozen=True)
class MoeFeedForward:
    """`DecoderVariant.feed_forward` of a MoE model: layer i's expert block, or its dense MLP."""

    spec: MoeSpec
    layout: str  # a key of layers.moe.CHECKPOINT_LAYOUTS
    expert_parallel: bool = False

    def __call__(self, config: Any, layer_idx: int, dtype: torch.dtype, fused: bool) -> nn.Module:
        if self.spec.sparse_layers[layer_idx]:
            return SparseMoeBlock(self.spec, config.hidden_size, dtype, self.layout,
                                  expert_parallel=self.expert_parallel, fused=fused)
        return LlamaMLP(config, DecoderVariant(), dtype, fused)


def qwen3_moe_variant(config: Any) -> DecoderVariant:
    bias = bool(getattr(config, "attention_bias", False))
    spec = moe_spec("Qwen3MoeForCausalLM", config)
    return DecoderVariant(qkv_bias=bias, o_proj_bias=bias, qk_norm=True,
                          feed_forward=MoeFeedForward(spec, "qwen3_moe"))


def mixtral_variant(config: Any) -> DecoderVariant:
    return DecoderVariant(feed_forward=MoeFeedForward(moe_spec("MixtralForCausalLM", config), "mixtral"))
