"""The EAGLE-3 head (vLLM's `Eagle3LlamaForCausalLM`): one Llama decoder layer over the target's features.

`forward(input_ids [T], positions [T], hidden [T, H], kv_caches (one), attn_meta) -> (normed, prenorm)`:
the layer normalises the token embeddings (`input_layernorm`) and the incoming hidden states
(`hidden_norm`), attends with q/k/v projected from their concatenation (2H wide), adds the attention
output to the incoming hidden states (the residual stream), then runs the MLP; `norm` gives the states the
LM head reads (`normed`) and the residual sum before it (`prenorm`), which is the next chained step's
`hidden`. The first step's `hidden` is `combine(aux)`: `fc` over the concatenated auxiliary hidden states
of the target ([T, 3 * target_hidden] -> [T, H]).

`compute_logits(normed [N, H]) -> float32 [N, vocab]` over the TARGET vocabulary: the head scores its
draft vocabulary, and draft id i lands on target id i + d2t[i]; every other target id gets `MASKED`
(zero probability after a softmax, finite so that a request's own masks cannot leave a row without any
finite logit). The token embedding is the target's unless the checkpoint has its own (`embed_tokens`).
Tensor-parallel like the target: heads split across ranks, `fc` replicated, the LM head vocab-sharded.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, cast

import torch
from torch import nn

from engine_svc.attention.backend import AttentionBackend, AttentionMetadata
from engine_svc.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine_svc.model.layers.linear import ReplicatedLinear, RowParallelLinear
from engine_svc.model.layers.norm import RMSNorm
from engine_svc.model.layers.rotary import RotaryEmbedding, RotaryInputs, read_rope_config
from engine_svc.model.llama import DecoderVariant, LlamaAttention, LlamaMLP, fused_kernels_wanted, head_dim_of
from engine_svc.spec.eagle3_head import Eagle3HeadInfo, checkpoint_name

MASKED = -1.0e30  # the logit of a target id outside the draft vocabulary


class Eagle3Layer(nn.Module):
    """The head's decoder layer: attention over cat(norm(embeds), norm(hidden)), residual = hidden."""

    def __init__(self, config: Any, backend: AttentionBackend, dtype: torch.dtype, fused: bool) -> None:
        super().__init__()
        hidden, bias = int(config.hidden_size), bool(getattr(config, "attention_bias", False))
        variant = DecoderVariant(qkv_bias=bias, o_proj_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)))
        wide = copy.copy(config)  # q/k/v read 2H; the output projection writes H
        wide.hidden_size, wide.head_dim = 2 * hidden, head_dim_of(config)
        self.self_attn = LlamaAttention(wide, variant, backend, dtype, fused)
        self.self_attn.o_proj = RowParallelLinear(config.num_attention_heads * wide.head_dim, hidden, bias, dtype)
        self.mlp = LlamaMLP(config, variant, dtype, fused)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, dtype, fused)
        self.hidden_norm = RMSNorm(hidden, eps, dtype, fused)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype, fused)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, rope: RotaryInputs, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual stream); `hidden` becomes the residual stream (updated in place)."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        x = self.self_attn(x, rope, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, hidden)
        return self.mlp(x), residual


class Eagle3Head(nn.Module):
    """See the module docstring. Parameter names are the checkpoint's (`midlayer.`, `fc.`, `norm.`, ...)."""

    draft_to_target: torch.Tensor  # [draft_vocab] target id of each draft id (a buffer)

    packed_modules: ClassVar[dict[str, tuple[tuple[str, Any], ...]]] = {
        "qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
        "gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
    }

    def __init__(self, info: Eagle3HeadInfo, backend: AttentionBackend, dtype: torch.dtype) -> None:
        from transformers import LlamaConfig

        super().__init__()
        config = LlamaConfig(**{k: v for k, v in info.config.items() if k not in ("architectures", "model_type")})
        hidden = int(config.hidden_size)
        target_hidden = int(getattr(config, "target_hidden_size", None) or hidden)
        fused = fused_kernels_wanted(backend)
        self.attn_backend = backend
        self.fc = ReplicatedLinear(len(info.aux_layer_ids) * target_hidden, hidden, False, dtype)
        self.midlayer = Eagle3Layer(config, backend, dtype, fused)
        self.norm = RMSNorm(hidden, config.rms_norm_eps, dtype, fused)
        self.lm_head = ParallelLMHead(info.draft_vocab_size, hidden, dtype) if info.has_lm_head else None
        self.embed_tokens = VocabParallelEmbedding(info.vocab_size, hidden, dtype) if info.has_embedding else None
        theta, rope_params = read_rope_config(config)
        self.rotary_emb = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings, theta, rope_params,
                                          dtype)
        self.fused = fused
        self.register_buffer("draft_to_target", torch.arange(info.draft_vocab_size), persistent=False)
        self.shared: dict[str, nn.Module] = {}  # the target's modules the head uses (not its parameters)
        self.aux_layer_ids = info.aux_layer_ids
        self.vocab_size = info.vocab_size
        self.draft_vocab_size = info.draft_vocab_size
        self.hidden_size, self.dtype = hidden, dtype
        self.num_layers = 1  # one KV cache
        self.num_kv_heads = self.midlayer.self_attn.num_kv_heads  # per TP rank
        self.head_dim = self.midlayer.self_attn.head_dim
        self.max_position = self.rotary_emb.max_position

    def share_with(self, target: Any) -> None:
        """Use the target's token embedding (and LM head, when the head has none of its own)."""
        if self.embed_tokens is None:
            self.shared["embed_tokens"] = target.model.embed_tokens
        if self.lm_head is None:
            self.shared["lm_head"] = target.lm_head

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The first step's hidden states from the target's auxiliary ones [T, 3 * target_hidden]."""
        out: torch.Tensor = self.fc(aux)
        return out

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed, prenorm) [T, H] each; `hidden` is consumed (updated in place)."""
        embed = self.embed_tokens if self.embed_tokens is not None else self.shared["embed_tokens"]
        rope = self.rotary_emb.inputs(positions, gather=not self.fused)
        x, residual = self.midlayer(embed(input_ids), hidden, rope, kv_caches[0], attn_meta)
        normed, prenorm = cast(tuple[torch.Tensor, torch.Tensor], self.norm(x, residual))
        return normed, prenorm

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """float32 logits over the target's vocabulary (see the module docstring)."""
        head = self.lm_head if self.lm_head is not None else self.shared["lm_head"]
        draft = cast(ParallelLMHead, head).compute_logits(normed)
        if self.draft_vocab_size == self.vocab_size and self.lm_head is None:
            return draft
        full = draft.new_full((draft.shape[0], self.vocab_size), MASKED)
        full[:, self.draft_to_target] = draft
        return full

    def load(self, head_dir: str | Path) -> None:
        """Fill the parameters from the head's safetensors (names as `checkpoint_name` gives them) and
        `draft_to_target` from d2t; every parameter must be loaded."""
        from engine_svc.model.loader import load_named_tensors

        d2t: list[torch.Tensor] = []

        def tensors() -> Iterator[tuple[str, torch.Tensor | None]]:
            from safetensors import safe_open

            for path in sorted(Path(head_dir).glob("*.safetensors")):
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    for raw in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                        name = checkpoint_name(raw)
                        if name == "d2t":
                            d2t.append(f.get_tensor(raw))
                        elif name != "t2d":
                            yield name, f.get_tensor(raw)

        load_named_tensors(self, tensors(), str(head_dir))
        if d2t:
            offsets = d2t[0].to(torch.int64).flatten()
            if offsets.numel() != self.draft_vocab_size:
                raise ValueError(f"d2t in {head_dir} has {offsets.numel()} entries, draft_vocab_size is "
                                 f"{self.draft_vocab_size}")
            ids = torch.arange(self.draft_vocab_size) + offsets
            if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size or len(set(ids.tolist())) != ids.numel():
                raise ValueError(f"d2t in {head_dir} maps draft ids outside [0, {self.vocab_size}) or two onto "
                                 "one target id")
            self.draft_to_target.copy_(ids)


def load_eagle3_head(head_dir: str, info: Eagle3HeadInfo, target: Any, dtype: torch.dtype,
                     device: torch.device, backend: AttentionBackend) -> Eagle3Head:
    """Build the head on `device`, load it, and share the target's modules it lacks."""
    with torch.device(device):
        head = Eagle3Head(info, backend, dtype)
    head.load(head_dir)
    head.share_with(target)
    return head.eval()
