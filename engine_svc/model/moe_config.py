"""What a mixture-of-experts config asks of the model, read once and checked at start (torch-free).

`moe_spec(arch, config)` turns a config.json (a dict, or a transformers config object) of a supported MoE
architecture into a `MoeSpec`: which layers are sparse, the routing rule, the experts' shape and
activation. Every config field that changes the math is either honoured here or refused with a
`MoeConfigError` naming the field; fields that only matter to training (`router_aux_loss_coef`,
`output_router_logits`, `router_jitter_noise`) are ignored. `EngineConfig.create` calls it before any
worker starts, and the model builds its layers from the same spec, so what was checked is what runs.

Routing rules (`MoeSpec.scoring`):
- "softmax_topk": softmax over all experts, then the top k (Qwen3-MoE, Mixtral); `renormalize` divides
  the k weights by their sum (Qwen3-MoE's `norm_topk_prob`; Mixtral always).
- "topk_softmax": the top k logits, then a softmax over those k (gpt-oss).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM")
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "swigluoai")
_MISSING = object()


class MoeConfigError(ValueError):
    """A MoE config field tandem cannot honour; the message names the field."""


@dataclass(frozen=True)
class MoeSpec:
    """The MoE shape of a model. `sparse_layers[i]` is True where layer i's feed-forward is the expert
    block, False where it is a dense MLP of `dense_intermediate_size`."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    scoring: str  # "softmax_topk" | "topk_softmax"
    renormalize: bool
    sparse_layers: tuple[bool, ...]
    dense_intermediate_size: int
    activation: str  # a key of ACTIVATIONS; "swigluoai" is gpt-oss's clamped SwiGLU
    expert_bias: bool = False  # per-expert biases on both projections, and a router bias
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


def _get(config: Any, *names: str, default: Any = _MISSING) -> Any:
    """The first of `names` present (and not None) in a dict or config object."""
    for name in names:
        value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
        if value is not None:
            return value
    if default is _MISSING:
        raise MoeConfigError(f"config.json lacks {names[0]!r}, which a MoE model needs")
    return default


def _positive(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise MoeConfigError(f"config field {name}={value!r} must be a positive integer")
    return value


def _experts_and_top_k(config: Any, experts_names: tuple[str, ...]) -> tuple[int, int]:
    num_experts = _positive(experts_names[0], _get(config, *experts_names))
    top_k = _positive("num_experts_per_tok", _get(config, "num_experts_per_tok"))
    if top_k > num_experts:
        raise MoeConfigError(f"config field num_experts_per_tok={top_k} exceeds the {num_experts} experts")
    return num_experts, top_k


def _refuse_quantization(config: Any) -> None:
    quant = _get(config, "quantization_config", default=None)
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else getattr(quant, "quant_method", "?")
        raise MoeConfigError(f"config field quantization_config (quant_method {method!r}) is not supported: "
                             "tandem serves MoE checkpoints in bfloat16/float16/float32 only (dequantize first)")


def _activation(config: Any) -> str:
    act = str(_get(config, "hidden_act", default="silu"))
    if act not in ACTIVATIONS or act == "swigluoai":
        raise MoeConfigError(f"config field hidden_act={act!r} is not supported "
                             f"(supported: {', '.join(a for a in ACTIVATIONS if a != 'swigluoai')})")
    return act


def _qwen3_moe(config: Any, num_layers: int) -> MoeSpec:
    num_experts, top_k = _experts_and_top_k(config, ("num_experts", "num_local_experts"))
    if _get(config, "shared_expert_intermediate_size", default=0):
        raise MoeConfigError("config field shared_expert_intermediate_size is set, but Qwen3MoeForCausalLM has no "
                             "shared expert (that is Qwen2-MoE's layout, which tandem does not serve)")
    step = _positive("decoder_sparse_step", _get(config, "decoder_sparse_step", default=1))
    dense_only = _get(config, "mlp_only_layers", default=[])
    if not isinstance(dense_only, (list, tuple)) or not all(isinstance(i, int) for i in dense_only):
        raise MoeConfigError(f"config field mlp_only_layers={dense_only!r} must be a list of layer indices")
    sparse = tuple(i not in dense_only and (i + 1) % step == 0 for i in range(num_layers))
    return MoeSpec(
        num_experts=num_experts, top_k=top_k,
        intermediate_size=_positive("moe_intermediate_size", _get(config, "moe_intermediate_size")),
        scoring="softmax_topk", renormalize=bool(_get(config, "norm_topk_prob", default=False)),
        sparse_layers=sparse, dense_intermediate_size=int(_get(config, "intermediate_size", default=0) or 0),
        activation=_activation(config),
    )


def _mixtral(config: Any, num_layers: int) -> MoeSpec:
    num_experts, top_k = _experts_and_top_k(config, ("num_local_experts", "num_experts"))
    size = _positive("intermediate_size", _get(config, "intermediate_size"))
    return MoeSpec(
        num_experts=num_experts, top_k=top_k, intermediate_size=size, scoring="softmax_topk", renormalize=True,
        sparse_layers=(True,) * num_layers, dense_intermediate_size=size, activation=_activation(config),
    )


LAYER_TYPES = ("sliding_attention", "full_attention")


def layer_windows(config: Any, num_layers: int) -> tuple[int | None, ...]:
    """gpt-oss: each layer's sliding window (None: full attention), from `layer_types` and `sliding_window`."""
    types = _get(config, "layer_types", default=None)
    if types is None:  # transformers' default: sliding, full, sliding, ...
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    if not isinstance(types, (list, tuple)) or len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise MoeConfigError(f"config field layer_types={types!r} must list one of {', '.join(LAYER_TYPES)} "
                             f"for each of the {num_layers} layers")
    window = _get(config, "sliding_window", default=None)
    if "sliding_attention" in types:
        window = _positive("sliding_window", window)
    return tuple(window if t == "sliding_attention" else None for t in types)


def _gpt_oss(config: Any, num_layers: int) -> MoeSpec:
    layer_windows(config, num_layers)  # checked here, at start
    num_experts, top_k = _experts_and_top_k(config, ("num_local_experts", "num_experts"))
    size = _positive("intermediate_size", _get(config, "intermediate_size"))
    return MoeSpec(
        num_experts=num_experts, top_k=top_k, intermediate_size=size, scoring="topk_softmax", renormalize=False,
        sparse_layers=(True,) * num_layers, dense_intermediate_size=size, activation="swigluoai",
        expert_bias=True, swiglu_alpha=float(_get(config, "swiglu_alpha", default=1.702)),
        swiglu_limit=float(_get(config, "swiglu_limit", default=7.0)),
    )


_SPECS = {"Qwen3MoeForCausalLM": _qwen3_moe, "MixtralForCausalLM": _mixtral, "GptOssForCausalLM": _gpt_oss}


def moe_spec(arch: str, config: Any) -> MoeSpec:
    """The `MoeSpec` of a config of MoE architecture `arch`; `MoeConfigError` naming a refused field."""
    if arch not in _SPECS:
        raise MoeConfigError(f"{arch!r} is not a mixture-of-experts architecture ({', '.join(MOE_ARCHITECTURES)})")
    _refuse_quantization(config)
    num_layers = _positive("num_hidden_layers", _get(config, "num_hidden_layers"))
    return _SPECS[arch](config, num_layers)


def check_expert_parallel(spec: MoeSpec, parallel_size: int) -> None:
    """Expert parallelism places num_experts / parallel_size whole experts on each rank."""
    if spec.num_experts % parallel_size:
        raise MoeConfigError(f"--enable-expert-parallel needs num_experts ({spec.num_experts}) divisible by "
                             f"--tensor-parallel-size ({parallel_size})")
