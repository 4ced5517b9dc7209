"""Load a model into tandem: a Hugging Face directory (config.json + *.safetensors) or a GGUF file.

Each checkpoint tensor (named as in HF checkpoints; a GGUF file's tensors are renamed and dequantized by
engine_svc/model/gguf.py) is handed, whole, to its parameter's `weight_loader`, which copies this TP
rank's shard. Fused parameters (see `packed_modules` on the model) receive several checkpoint
tensors, one per shard_id. A module with a `checkpoint_shards(prefix, param)` method names the
checkpoint tensors of its own parameters instead (a MoE block: one tensor per expert, stacked into one
parameter). Every parameter shard must be loaded exactly once or loading fails.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from engine_svc.attention.backend import AttentionBackend
from engine_svc.model import gguf
from engine_svc.model.registry import build_model

logger = logging.getLogger(__name__)

_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_config(model_dir: str | Path) -> Any:
    """The transformers config of a local model directory or GGUF file (never touches the network)."""
    from transformers import AutoConfig

    if gguf.is_gguf(model_dir):
        fields = gguf.gguf_hf_config(model_dir)
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype | str,
    device: torch.device | str,
    attn_backend: AttentionBackend,
    expert_parallel: bool = False,
) -> nn.Module:
    """Build the model named by `model_dir/config.json` (or a GGUF file) on `device` and load its weights."""
    model = build_model(load_config(model_dir), dtype, device, attn_backend, expert_parallel)
    load_weights(model, model_dir)
    return model


def checkpoint_names(model: nn.Module) -> list[str]:
    """The HF checkpoint tensor names `model` loads (lm_head.weight included, even when tied)."""
    return sorted(set(_expected_shards(model, getattr(model, "packed_modules", {})).values()))


def _shard_namers(model: nn.Module) -> dict[str, Any]:
    """module path -> module, for the modules that name their own checkpoint tensors."""
    return {name: m for name, m in model.named_modules() if callable(getattr(m, "checkpoint_shards", None))}


def _namer_of(param: str, namers: dict[str, Any]) -> tuple[str, Any] | None:
    """(module path, module) of the innermost module above `param` that names its checkpoint tensors."""
    parts = param.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:cut])
        if prefix in namers:
            return prefix, namers[prefix]
    return None


def _expected_shards(
    model: nn.Module, packed: dict[str, tuple[tuple[str, Any], ...]]
) -> dict[tuple[str, Any], str]:
    """(param name, shard_id) -> checkpoint tensor name, for every tensor the checkpoint must hold."""
    expected = {}
    namers = _shard_namers(model)
    for name, _ in model.named_parameters():
        owner = _namer_of(name, namers) if namers else None
        if owner is not None:
            prefix, module_obj = owner
            for ckpt, shard in module_obj.checkpoint_shards(prefix, name[len(prefix) + 1 :]):
                expected[(name, shard)] = ckpt
            continue
        *path, module, leaf = name.split(".")
        for part, shard in packed.get(module, ((module, None),)):
            expected[(name, shard)] = ".".join([*path, part, leaf])
    return expected


def load_weights(model: nn.Module, model_dir: str | Path) -> None:
    """Fill every parameter of `model` from `model_dir/*.safetensors`, or from a GGUF file.

    Raises FileNotFoundError without safetensors files and ValueError naming the checkpoint tensors
    that are missing. Without `lm_head.weight` in the checkpoint the LM head is tied to the embedding.
    """
    if gguf.is_gguf(model_dir):
        dtype = next(model.parameters()).dtype
        tensors = gguf.iter_gguf_weights(model_dir, checkpoint_names(model), dtype)
    else:
        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
        tensors = _safetensors_tensors(files, set(checkpoint_names(model)))
    load_named_tensors(model, tensors, str(model_dir))


def _safetensors_tensors(files: list[Path], wanted: set[str]) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Every tensor name in the files; the tensor itself only for `wanted` names (others are not read)."""
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, (f.get_tensor(name) if name in wanted else None)


def load_named_tensors(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor | None]],
                       source: str) -> None:
    """Hand each (checkpoint name, tensor) to its parameter's weight loader; check nothing is missing.
    A None tensor is one the caller did not read because the model does not load it."""
    params = dict(model.named_parameters())
    expected = _expected_shards(model, getattr(model, "packed_modules", {}))
    by_checkpoint = {ckpt: key for key, ckpt in expected.items()}
    loaded: set[tuple[str, Any]] = set()
    ignored: list[str] = []
    for name, tensor in tensors:
        key = by_checkpoint.get(name)
        if tensor is None or name.endswith(_SKIPPED_SUFFIXES) or key is None:
            ignored.append(name)
            continue
        target, shard = key
        param = params[target]
        param.weight_loader(param, tensor, shard)  # type: ignore[attr-defined]
        loaded.add(key)
    if ("lm_head.weight", None) in expected and ("lm_head.weight", None) not in loaded:
        model.tie_lm_head()  # type: ignore[operator]
        del expected[("lm_head.weight", None)]
    missing = sorted(ckpt for key, ckpt in expected.items() if key not in loaded)
    if missing:
        raise ValueError(
            f"checkpoint in {source} lacks {len(missing)} weight(s): {', '.join(missing[:10])}"
        )
    owned = getattr(model, "owns_checkpoint_tensor", None)  # other pipeline stages' tensors are expected
    unexpected = [n for n in ignored if not n.endswith(_SKIPPED_SUFFIXES) and n != "lm_head.weight"
                  and (owned is None or owned(n))]
    if unexpected:
        logger.warning(
            "ignored %d unexpected checkpoint tensor(s): %s", len(unexpected), ", ".join(unexpected[:10])
        )
