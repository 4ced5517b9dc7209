"""Architecture name (config.json `architectures[0]`) -> model class and variant; `build_model`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from engine_svc.attention.backend import AttentionBackend
from engine_svc.model.llama import DecoderVariant, LlamaForCausalLM
from engine_svc.model.moe_models import MoeFeedForward, gpt_oss_variant, mixtral_variant, qwen3_moe_variant
from engine_svc.model.windows import layer_windows


def _llama(config: Any) -> DecoderVariant:
    bias = bool(getattr(config, "attention_bias", False))
    return DecoderVariant(qkv_bias=bias, o_proj_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)))


def _qwen2(config: Any) -> DecoderVariant:
    return DecoderVariant(qkv_bias=True)


def _qwen3(config: Any) -> DecoderVariant:
    bias = bool(getattr(config, "attention_bias", False))
    return DecoderVariant(qkv_bias=bias, o_proj_bias=bias, qk_norm=True)


_ARCHITECTURES: dict[str, tuple[type[nn.Module], Callable[[Any], DecoderVariant]]] = {
    "LlamaForCausalLM": (LlamaForCausalLM, _llama),
    "MistralForCausalLM": (LlamaForCausalLM, _llama),
    "Qwen2ForCausalLM": (LlamaForCausalLM, _qwen2),
    "Qwen3ForCausalLM": (LlamaForCausalLM, _qwen3),
    "Qwen3MoeForCausalLM": (LlamaForCausalLM, qwen3_moe_variant),
    "MixtralForCausalLM": (LlamaForCausalLM, mixtral_variant),
    "GptOssForCausalLM": (LlamaForCausalLM, gpt_oss_variant),
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def resolve_architecture(hf_config: Any, expert_parallel: bool = False) -> tuple[type[nn.Module], DecoderVariant]:
    """(model class, variant) for the config; ValueError naming the architecture if unsupported, or
    asked for expert parallelism without experts."""
    archs = getattr(hf_config, "architectures", None) or []
    arch = archs[0] if archs else None
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"unsupported model architecture {arch!r}; supported: {', '.join(supported_architectures())}"
        )
    cls, variant_of = _ARCHITECTURES[arch]
    variant = variant_of(hf_config)
    if variant.layer_windows is None:  # the dense models' (and Mixtral's, Qwen3-MoE's) sliding windows
        windows = layer_windows(arch, hf_config, int(hf_config.num_hidden_layers))
        if windows is not None:
            variant = replace(variant, layer_windows=windows)
    if expert_parallel:
        if not isinstance(variant.feed_forward, MoeFeedForward):
            raise ValueError(f"--enable-expert-parallel needs a mixture-of-experts model; {arch} has no experts")
        variant = replace(variant, feed_forward=replace(variant.feed_forward, expert_parallel=True))
    return cls, variant


def resolve_dtype(dtype: torch.dtype | str, hf_config: Any = None) -> torch.dtype:
    """A torch dtype from a dtype, its name ("bfloat16", "float32", "half", ...), or "auto" (the
    checkpoint's dtype, float32 if it names none)."""
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype == "auto":
        raw = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
        resolved = raw if isinstance(raw, torch.dtype) else _DTYPES.get(str(raw), torch.float32)
    else:
        aliases = {
            "half": "float16",
            "fp16": "float16",
            "bf16": "bfloat16",
            "float": "float32",
            "fp32": "float32",
        }
        name = aliases.get(dtype, dtype)
        if name not in _DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; supported: auto, {', '.join(_DTYPES)}")
        resolved = _DTYPES[name]
    if resolved not in _DTYPES.values():
        raise ValueError(f"unsupported dtype {resolved}; supported: {', '.join(_DTYPES)}")
    return resolved


def build_model(
    hf_config: Any, dtype: torch.dtype | str, device: torch.device | str, attn_backend: AttentionBackend,
    expert_parallel: bool = False,
) -> nn.Module:
    """An uninitialised model (weights are `torch.empty`) on `device`; fill it with `load_weights`.
    `expert_parallel`: a MoE model's experts are placed whole on the TP ranks instead of sharded."""
    cls, variant = resolve_architecture(hf_config, expert_parallel)
    with torch.device(device):
        model = cls(hf_config, variant, attn_backend, resolve_dtype(dtype, hf_config))
    return model.eval()
