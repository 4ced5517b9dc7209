"""Read and validate one PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors`).

What is served: `peft_type` LORA on the decoder layers' q/k/v/o and gate/up/down projections, any rank in
[1, --max-lora-rank], `lora_alpha` with PEFT's scaling (`lora_alpha / r`, or `lora_alpha / sqrt(r)` with
`use_rslora`). Refused with an error naming the file and field: a missing file, another PEFT type, DoRA,
trained biases, `modules_to_save`, rank/alpha patterns, `fan_in_fan_out`, a tensor the model has no place
for (unknown module, layer past the model's), a shape that does not match the model, an A without its B,
and a non-finite weight. Everything is checked before the adapter is returned, so a refused adapter
changes nothing.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\."
                  r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter directory that cannot be served; the message names the adapter and the problem."""


@dataclass(frozen=True)
class PeftAdapter:
    """One adapter, validated: `weights[(layer, module)] = (A [r, in], B [out, r] * scaling)` in float32."""

    name: str
    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def module_shapes(hf_config: Any, with_mlp: bool = True) -> dict[str, tuple[int, int]]:
    """(out, in) of each LoRA-targetable projection of a Llama-family decoder layer (full, unsharded)."""
    hidden = int(hf_config.hidden_size)
    heads = int(hf_config.num_attention_heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or hidden // heads)
    kv = int(getattr(hf_config, "num_key_value_heads", None) or heads) * head_dim
    shapes = {"q_proj": (heads * head_dim, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
              "o_proj": (hidden, heads * head_dim)}
    if with_mlp:
        inter = int(hf_config.intermediate_size)
        shapes.update(gate_proj=(inter, hidden), up_proj=(inter, hidden), down_proj=(hidden, inter))
    return shapes


def load_peft_adapter(name: str, path: str, *, max_rank: int, num_layers: int,
                      shapes: dict[str, tuple[int, int]], pause: Callable[[], None] | None = None) -> PeftAdapter:
    """The adapter at `path`, validated against the model (`num_layers`, `shapes` of the targetable
    projections it has) and `max_rank`. Raises LoRAAdapterError."""
    directory = Path(path)
    config = _read_config(name, directory)
    rank, scaling = _rank_and_scaling(name, config, max_rank)
    raw = _read_weights(name, directory, max_weights_bytes(rank, num_layers, shapes))
    weights: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in raw.items():
        if pause is not None:
            pause()
        match = _KEY.match(key)
        if match is None:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds {key!r}, which tandem cannot "
                                   "apply (only lora_A/lora_B of q/k/v/o/gate/up/down_proj in the decoder layers)")
        layer, module, which = int(match[1]), match[2], match[3]
        if layer >= num_layers:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {key!r} is for layer {layer}; the model has {num_layers}")
        if module not in shapes:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: targets {module}, which this model lacks "
                                   f"(it has {', '.join(shapes)})")
        out_dim, in_dim = shapes[module]
        want = (rank, in_dim) if which == "A" else (out_dim, rank)
        if tuple(tensor.shape) != want:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {key!r} has shape {tuple(tensor.shape)}, expected {want}")
        if not torch.isfinite(tensor).all():
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {key!r} holds non-finite values")
        weights.setdefault((layer, module), {})[which] = tensor.to(torch.float32)
    if not weights:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    pairs = {}
    for (layer, module), ab in weights.items():
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: layer {layer} {module} has lora_{''.join(ab)} "
                                   "without its pair")
        pairs[(layer, module)] = (ab["A"], ab["B"] * scaling)
    return PeftAdapter(name=name, path=path, rank=rank, scaling=scaling, weights=pairs)


def validate_for_model(model: str, architecture: str, max_rank: int, name: str, path: str) -> PeftAdapter:
    """The adapter at `path` checked as the workers will check it, from the model's config alone (for the
    engine process, which has no model: a run-time load, engine_svc/lora/registry.py). Blocking."""
    num_layers, shapes = _model_shapes(model, architecture)
    return load_peft_adapter(name, path, max_rank=max_rank, num_layers=num_layers, shapes=shapes)


@cache
def _model_shapes(model: str, architecture: str) -> tuple[int, dict[str, tuple[int, int]]]:
    """The decoder's layer count and its LoRA-targetable projections' shapes (attention only for MoE models,
    as the workers attach them, engine_svc/lora/manager.py)."""
    from engine_svc.model.loader import load_config
    from engine_svc.model.moe_config import MOE_ARCHITECTURES

    hf_config = load_config(model)
    return int(hf_config.num_hidden_layers), module_shapes(hf_config, with_mlp=architecture not in MOE_ARCHITECTURES)


def _read_config(name: str, directory: Path) -> dict[str, Any]:
    file = directory / CONFIG_FILE
    if not file.is_file():
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {file} does not exist (expected a PEFT adapter directory "
                               f"with {CONFIG_FILE} and {WEIGHTS_FILE})")
    if file.stat().st_size > MAX_CONFIG_BYTES:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {file} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {file} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {file} is not a JSON object")
    return config


def _rank_and_scaling(name: str, config: dict[str, Any], max_rank: int) -> tuple[int, float]:
    def refuse(why: str) -> LoRAAdapterError:
        return LoRAAdapterError(f"LoRA adapter {name!r}: {CONFIG_FILE} {why}")

    if config.get("peft_type", "LORA") != "LORA":
        raise refuse(f"peft_type is {config.get('peft_type')!r}; only LORA is served")
    rank, alpha = config.get("r"), config.get("lora_alpha", 8)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise refuse(f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise refuse(f"r {rank} is above --max-lora-rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise refuse(f"lora_alpha must be a finite number, got {alpha!r}")
    for field, served in (("use_dora", False), ("fan_in_fan_out", False), ("bias", "none")):
        if config.get(field, served) != served:
            raise refuse(f"{field} is {config[field]!r}; only {served!r} is served")
    for field in ("modules_to_save", "rank_pattern", "alpha_pattern"):
        if config.get(field):
            raise refuse(f"{field} is set; adapters with {field} are not served")
    return rank, alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def max_weights_bytes(rank: int, num_layers: int, shapes: dict[str, tuple[int, int]]) -> int:
    """The largest adapter_model.safetensors a rank-`rank` adapter of this model can be (float64 A and B on
    every targetable module of every layer, and the header); a larger file is refused before it is read."""
    return 8 * rank * num_layers * sum(out + in_ for out, in_ in shapes.values()) + MAX_CONFIG_BYTES


def _read_weights(name: str, directory: Path, max_bytes: int) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = directory / WEIGHTS_FILE
    if not file.is_file():
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {file} does not exist")
    if file.stat().st_size > max_bytes:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {file} is {file.stat().st_size} bytes, more than an "
                               f"adapter of rank {max_bytes and ''}r for this model can hold ({max_bytes} bytes)")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as e:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {file} is not a readable safetensors file: {e}") from e
