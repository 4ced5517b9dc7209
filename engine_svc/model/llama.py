"""Llama-family decoder: Llama 2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm, explicit head_dim),
and the mixture-of-experts models built on it (engine_svc/model/moe_models.py: a `DecoderVariant` may
replace each layer's feed-forward block, add attention sinks and give layers sliding windows).

Pre-norm decoder layers; the residual stream is carried beside the activations so each RMSNorm also
does the preceding residual add. Module and parameter names follow the HF checkpoints, except for
the fused ones listed in `LlamaForCausalLM.packed_modules`.

Two numerically equivalent paths (`fused_kernels_wanted`):
- torch ops (the torch attention backend; HF-exact in float32 on CPU); on CPU in float32 / bfloat16 the
  native ops of engine_svc/attention/csrc/ (cpu_paged.py) replace the small ones where built: residual
  add + RMSNorm and RoPE in place, SiLU-and-mul (the torch ops stay the fallback and the reference);
- fused Triton kernels (the Triton attention backend, on CUDA or under TRITON_INTERPRET): residual add +
  RMSNorm in place, q/k norm + RoPE in place on the qkv output with the KV-cache write fused in
  (the backend is told the cache is written), and SiLU-and-mul. Per layer a decode step then runs
  norm, qkv GEMM, rope+cache, attention, o GEMM, norm, gate_up GEMM, silu_and_mul, down GEMM.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch
from torch import nn

from engine_svc.attention import cpu_paged
from engine_svc.attention.backend import AttentionBackend, AttentionMetadata
from engine_svc.distributed.parallel_state import get_pp_rank, get_pp_size, pp_layer_range
from engine_svc.kv.groups import KVGroups, hybrid_groups
from engine_svc.model.layers.activation import GatedActivation
from engine_svc.model.layers.attention import Attention
from engine_svc.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine_svc.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    make_param,
)
from engine_svc.model.layers.norm import QKNorm, RMSNorm
from engine_svc.model.layers.rotary import RotaryEmbedding, RotaryInputs, apply_rotary, read_rope_config
from engine_svc.model.windows import kv_window
from kernels import rope as triton_rope  # importing kernels never imports triton

FUSED_KERNELS_ENV = "TANDEM_FUSED_KERNELS"


def fused_kernels_wanted(backend: AttentionBackend) -> bool:
    """Fused Triton kernels run exactly when attention runs on the Triton backend (which needs CUDA or
    TRITON_INTERPRET=1 anyway); TANDEM_FUSED_KERNELS=0 keeps the torch ops there too (A/B profiling)."""
    return getattr(backend, "name", "") == "triton" and os.environ.get(FUSED_KERNELS_ENV, "1") != "0"


@dataclass(frozen=True)
class DecoderVariant:
    """What distinguishes the supported architectures from plain Llama."""

    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # Builds layer i's feed-forward block: (config, layer index, dtype, fused) -> module; None: LlamaMLP.
    # Mixture-of-experts models set it (engine_svc/model/moe_models.py).
    feed_forward: Callable[[Any, int, torch.dtype, bool], nn.Module] | None = None
    attention_sinks: bool = False  # a learned sink logit per query head (`self_attn.sinks`, gpt-oss)
    layer_windows: tuple[int | None, ...] | None = None  # layer i's sliding window (None: full attention)


def head_dim_of(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


class LlamaAttention(nn.Module):
    def __init__(
        self, config: Any, variant: DecoderVariant, backend: AttentionBackend, dtype: torch.dtype,
        fused: bool = False, layer_idx: int = 0,
    ) -> None:
        super().__init__()
        self.fused = fused
        head_dim = head_dim_of(config)
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head_dim, config.num_attention_heads, num_kv_heads, variant.qkv_bias, dtype
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim, config.hidden_size, variant.o_proj_bias, dtype
        )
        self.qk_norm = (
            QKNorm(self.num_heads, self.num_kv_heads, head_dim, config.rms_norm_eps, dtype)
            if variant.qk_norm
            else None
        )
        window = variant.layer_windows[layer_idx] if variant.layer_windows else None
        groups = hybrid_groups(variant.layer_windows)
        self.kv_group = groups.layer_group[layer_idx] if groups is not None else 0  # its hybrid KV group
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, head_dim**-0.5, backend, window)
        self.sinks = make_param((self.num_heads,), dtype, self._load_sinks) if variant.attention_sinks else None

    def _load_sinks(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        """This rank's query heads' sink logits (heads are split across ranks as the q projection's)."""
        mine = loaded.narrow(0, self.qkv_proj.tp_rank * self.num_heads, self.num_heads)
        if mine.shape != param.shape:
            raise ValueError(f"shape mismatch loading sinks: {tuple(param.shape)} vs {tuple(mine.shape)}")
        param.data.copy_(mine)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: RotaryInputs,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if meta.groups is not None:
            meta = meta.groups[self.kv_group]
        qkv = self.qkv_proj(hidden).view(hidden.shape[0], -1, self.head_dim)
        num_heads, num_qk = self.num_heads, self.num_heads + self.num_kv_heads
        if self.fused:
            norm = self.qk_norm
            triton_rope.rotary_qkv_(
                qkv, rope.positions, rope.cos_sin_cache, num_heads, self.num_kv_heads,
                qk_norm_weight=None if norm is None else norm.weight, eps=1e-6 if norm is None else norm.eps,
                kv_cache=kv_cache, slot_mapping=meta.slot_mapping,
            )
            out = self.attn(qkv[:, :num_heads], qkv[:, num_heads:num_qk], qkv[:, num_qk:], kv_cache, meta,
                            kv_written=True, sinks=self.sinks)
        else:
            assert rope.cos is not None and rope.sin is not None
            qk = qkv[:, :num_qk]
            if self.qk_norm is not None:
                qk = self.qk_norm(qk)
            native = cpu_paged.for_tensor(qk) if rope.positions.dtype == torch.int64 else None
            if native is not None:  # in place on the projection's rows (the model owns them)
                native.rotary_(qk, rope.positions, rope.cos_sin_cache)
            else:
                qk = apply_rotary(qk, rope.cos, rope.sin)
            out = self.attn(qk[:, :num_heads], qk[:, num_heads:], qkv[:, num_qk:], kv_cache, meta, sinks=self.sinks)
        projected: torch.Tensor = self.o_proj(out)
        return projected


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, variant: DecoderVariant, dtype: torch.dtype, fused: bool = False) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], variant.mlp_bias, dtype
        )
        self.act = GatedActivation(config.hidden_act, fused=fused)
        self.down_proj = RowParallelLinear(size, config.hidden_size, variant.mlp_bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.act(self.gate_up_proj(x)))
        return out


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: Any, variant: DecoderVariant, backend: AttentionBackend, dtype: torch.dtype,
        fused: bool = False, layer_idx: int = 0,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, variant, backend, dtype, fused, layer_idx)
        self.mlp = (LlamaMLP(config, variant, dtype, fused) if variant.feed_forward is None
                    else variant.feed_forward(config, layer_idx, dtype, fused))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, fused)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, fused)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RotaryInputs,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(layer input, residual stream) -> (MLP output, residual stream); their sum is the layer output.

        With fused kernels both tensors passed in are updated in place (the model owns them all)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class MissingLayer(nn.Module):
    """A layer another pipeline stage owns: no parameters, never called (it keeps layer indices, and so
    parameter names, as in the checkpoint)."""


# A stage that is not the last returns its hidden states and residual stream for the next stage.
Intermediate = tuple[torch.Tensor, torch.Tensor]


class LlamaModel(nn.Module):
    """The decoder stack of one pipeline stage (the whole stack with one stage): the embedding on the
    first stage (and on the last when the LM head is tied to it), layers [start_layer, end_layer), the
    final norm on the last stage."""

    def __init__(
        self, config: Any, variant: DecoderVariant, backend: AttentionBackend, dtype: torch.dtype,
        fused: bool = False,
    ) -> None:
        super().__init__()
        self.fused = fused
        self.start_layer, self.end_layer = pp_layer_range(config.num_hidden_layers)
        self.is_first_stage = get_pp_rank() == 0
        self.is_last_stage = get_pp_rank() == get_pp_size() - 1
        tied = bool(getattr(config, "tie_word_embeddings", False))
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
                             if self.is_first_stage or (self.is_last_stage and tied) else None)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, variant, backend, dtype, fused, i)
            if self.start_layer <= i < self.end_layer else MissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, fused) if self.is_last_stage else None
        theta, rope_params = read_rope_config(config)
        self.rotary_emb = RotaryEmbedding(
            head_dim_of(config), config.max_position_embeddings, theta, rope_params, dtype
        )
        # EAGLE-3 (engine_svc/model/eagle3.py): the layers whose inputs each forward keeps, concatenated in
        # this order, in `aux_hidden` [T, len * hidden]; empty (nothing kept) unless a head reads them.
        self.aux_layer_ids: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_meta: AttentionMetadata,
        intermediate: Intermediate | None = None,
    ) -> torch.Tensor | Intermediate:
        """The normed hidden states on the last stage, else (hidden, residual) for the next stage. A stage
        after the first starts from the previous stage's `intermediate`; `kv_caches` holds this stage's
        layers' caches only."""
        residual: torch.Tensor | None
        if intermediate is None:
            assert self.embed_tokens is not None, "a stage after the first needs the previous stage's output"
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = intermediate
        rope = self.rotary_emb.inputs(positions, gather=not self.fused)
        aux_ids = self.aux_layer_ids
        kept: dict[int, torch.Tensor] = {}
        for i, (layer, kv_cache) in enumerate(zip(self.layers[self.start_layer:self.end_layer], kv_caches,
                                                  strict=True)):
            if aux_ids and i in aux_ids:  # the layer's input: the residual stream plus the pending output
                kept[i] = hidden.clone() if residual is None else hidden + residual  # owned copies
            hidden, residual = layer(hidden, residual, rope, kv_cache, attn_meta)
        if aux_ids:
            self.aux_hidden = torch.cat([kept[i] for i in aux_ids], dim=-1)
        if self.norm is None:
            assert residual is not None
            return hidden, residual
        normed: torch.Tensor = self.norm(hidden, residual)[0]
        return normed


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head.

    `forward(input_ids [T], positions [T], kv_caches (one per layer), attn_meta) -> hidden [T, hidden]`
    (with pipeline stages: one cache per layer of this stage; a stage before the last returns
    (hidden, residual) and a later one takes them as `intermediate`);
    `compute_logits(hidden [N, hidden]) -> float32 [N, vocab]`.
    """

    # fused parameter -> (checkpoint module name, shard_id) for each of its parts
    packed_modules: ClassVar[dict[str, tuple[tuple[str, Any], ...]]] = {
        "qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
        "gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
        "qk_norm": (("q_norm", "q"), ("k_norm", "k")),
    }

    def __init__(
        self, config: Any, variant: DecoderVariant, backend: AttentionBackend, dtype: torch.dtype,
        fused: bool | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.attn_backend = backend  # its kv_cache_shape lays out the caches this model reads
        self.fused_kernels = fused_kernels_wanted(backend) if fused is None else fused
        self.model = LlamaModel(config, variant, backend, dtype, self.fused_kernels)
        self.lm_head = (ParallelLMHead(config.vocab_size, config.hidden_size, dtype)
                        if self.model.is_last_stage else None)
        if getattr(config, "tie_word_embeddings", False) and self.lm_head is not None:
            self.tie_lm_head()
        attn = cast(LlamaDecoderLayer, self.model.layers[self.model.start_layer]).self_attn
        self.is_first_stage, self.is_last_stage = self.model.is_first_stage, self.model.is_last_stage
        self.hidden_size = int(config.hidden_size)
        self.num_layers = self.model.end_layer - self.model.start_layer  # this stage's: one KV cache each
        self.num_kv_heads = attn.num_kv_heads  # per TP rank
        self.head_dim = attn.head_dim
        self.vocab_size = config.vocab_size
        self.dtype = dtype
        self.max_position = self.model.rotary_emb.max_position  # positions must stay below it
        # Each layer's attention applies its own window (variant.layer_windows); this is the window all
        # layers share (None when some layer attends to everything), behind which KV blocks may be freed.
        self.sliding_window: int | None = kv_window(variant.layer_windows)
        # Its layers' hybrid KV groups (engine_svc/kv/groups.py), used when the engine runs them.
        self.kv_groups: KVGroups | None = hybrid_groups(variant.layer_windows)

    @property
    def is_tied(self) -> bool:
        embed = self.model.embed_tokens
        return self.lm_head is not None and embed is not None and self.lm_head.weight is embed.weight

    def tie_lm_head(self) -> None:
        """Use the input embedding as the output projection (both are sharded the same way)."""
        assert self.lm_head is not None and self.model.embed_tokens is not None
        self.lm_head.weight = self.model.embed_tokens.weight

    def owns_checkpoint_tensor(self, name: str) -> bool:
        """Whether this pipeline stage loads checkpoint tensor `name` (always true with one stage)."""
        if name.startswith("model.layers."):
            index = name.split(".", 3)[2]
            return not index.isdigit() or self.model.start_layer <= int(index) < self.model.end_layer
        if name.startswith("model.embed_tokens."):
            return self.model.embed_tokens is not None
        if name.startswith("model.norm."):
            return self.model.norm is not None
        if name.startswith("lm_head."):
            return self.lm_head is not None
        return True

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_meta: AttentionMetadata,
        intermediate: Intermediate | None = None,
    ) -> torch.Tensor | Intermediate:
        """Hidden states [T, hidden] on the last stage, else (hidden, residual) for the next stage."""
        out: torch.Tensor | Intermediate = self.model(input_ids, positions, kv_caches, attn_meta, intermediate)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "only the last pipeline stage computes logits"
        return self.lm_head.compute_logits(hidden)
