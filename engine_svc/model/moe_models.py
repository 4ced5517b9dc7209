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
- gpt-oss: q/k/v/o biases, a learned attention sink per head (`self_attn.sinks`), sliding-window and full
  attention layers as `layer_types` says, YaRN rotary; top-k then softmax routing with a router bias, and
  experts with biases and clamped SwiGLU, stored stacked (`mlp.experts.gate_up_proj` [E, H, 2I] with gate
  and up columns interleaved, `mlp.experts.down_proj` [E, I, H], their biases, `mlp.router.*`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine_svc.model.layers.moe import SparseMoeBlock
from engine_svc.model.llama import DecoderVariant, LlamaMLP
from engine_svc.model.moe_config import MoeSpec, layer_windows, moe_spec


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


def gpt_oss_variant(config: Any) -> DecoderVariant:
    spec = moe_spec("GptOssForCausalLM", config)
    return DecoderVariant(qkv_bias=True, o_proj_bias=True, attention_sinks=True,
                          layer_windows=layer_windows(config, config.num_hidden_layers),
                          feed_forward=MoeFeedForward(spec, "gpt_oss"))
