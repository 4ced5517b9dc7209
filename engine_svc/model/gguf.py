"""GGUF checkpoints (llama.cpp's one-file format) served as Llama-family models, dequantized at load.

A .gguf holds the model config as metadata under llama.cpp's key names and the tensors under llama.cpp's
names (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md), most of them quantized. Reading uses
the `gguf` package (llama.cpp's gguf-py: metadata, tensor-name tables, numpy dequantization) and
transformers' GGUF-key -> config-key table, so no mapping is written by hand here.

- `gguf_hf_config(path)`: the Hugging Face config.json the file describes (a plain dict).
- `iter_gguf_weights(path, names, dtype)`: (HF checkpoint name, tensor) for the wanted names, one tensor
  at a time, dequantized straight into `dtype`: a load never holds two copies of the model.
- `metadata_only(path)`: the file without its tensors (what GetTokenizer serves for a .gguf model).

Invariants:
- Only architectures tandem serves are accepted (`GGUF_ARCHITECTURES`: Llama, Mistral, Qwen2, Qwen3,
  Qwen3-MoE, and Mixtral, which llama.cpp files as "llama" with experts; a file with shared experts is
  refused by name), and only tensor types whose
  dequantization is exact to float32 (`SUPPORTED_TENSOR_TYPES`); anything else is a `GGUFError` that
  names what the file holds and what is supported, raised before any weight is read.
- llama.cpp stores the q/k projections of the "llama" architecture permuted for its interleaved rotary
  layout; they come back un-permuted (HF's half-split layout). Other architectures are stored as is.
- A file without an `output.weight` tensor has tied embeddings (`tie_word_embeddings: true`).
- A layer's experts are one stacked tensor in the file and one tensor per expert in an HF checkpoint:
  each expert's slice is handed on under its HF name.
- The model's own dtype (`dtype` in the config) is the file's float type when its weights are plain
  floats; a quantized file has none, and its exact dequantization is float32.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

# GGUF "general.architecture" -> the HF architecture tandem builds for it. Mistral files say "llama";
# so do Mixtral files, which have experts (`MIXTRAL`).
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
MIXTRAL = "MixtralForCausalLM"
# GGUF architecture -> transformers' model_type (the key of its GGUF config table too).
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.([^.]+)$")  # HF per-expert module name: prefix, index, projection
# Plain floats plus the block formats gguf-py dequantizes (legacy and k-quants).
SUPPORTED_TENSOR_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip
_FLOAT_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_PERMUTED_QK_ARCHS = ("llama",)


class GGUFError(ValueError):
    """The GGUF file cannot be served; the message says what it holds and what is supported."""


def is_gguf(path: str | Path) -> bool:
    """True for an existing file named *.gguf (what `--model` accepts besides an HF directory)."""
    p = Path(path)
    return p.suffix.lower() == ".gguf" and p.is_file()


@lru_cache(maxsize=4)
def _reader(path: str) -> Any:
    """The file's `gguf.GGUFReader` (memory-mapped; parsing the metadata takes ~2 s for a 49k vocab)."""
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise GGUFError(f"{path} is not a readable GGUF file: {exc}") from exc


def read_metadata(path: str | Path, keys: Iterable[str] | None = None) -> dict[str, Any]:
    """The file's metadata as Python values (all keys, or only `keys`)."""
    fields = _reader(str(path)).fields
    names = fields.keys() if keys is None else [k for k in keys if k in fields]
    return {k: fields[k].contents() for k in names}


def _architecture(path: str | Path) -> str:
    arch = read_metadata(path, ["general.architecture"]).get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFError(f"{path}: GGUF architecture {arch!r} is not supported; tandem serves GGUF files of "
                        f"architecture {', '.join(GGUF_ARCHITECTURES)} (Llama, Mistral, SmolLM, Qwen2, Qwen3, Qwen3-MoE, Mixtral)")
    return str(arch)


def _tensor_types(path: str | Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in _reader(str(path)).tensors}


def check_supported(path: str | Path) -> str:
    """The file's architecture; `GGUFError` for an unsupported architecture, tensor type or rope scaling."""
    arch = _architecture(path)
    types = _tensor_types(path)
    bad = sorted({t for t in types.values() if t not in SUPPORTED_TENSOR_TYPES})
    if bad:
        raise GGUFError(f"{path} holds tensors of type {', '.join(bad)}, which tandem cannot dequantize; "
                        f"supported types: {', '.join(SUPPORTED_TENSOR_TYPES)}")
    experts = read_metadata(path, [f"{arch}.expert_count", f"{arch}.expert_shared_count"])
    if arch == "qwen3moe" and not experts.get(f"{arch}.expert_count"):
        raise GGUFError(f"{path}: a qwen3moe file without {arch}.expert_count")
    if experts.get(f"{arch}.expert_shared_count"):
        raise GGUFError(f"{path} has shared experts ({arch}.expert_shared_count = "
                        f"{experts[f'{arch}.expert_shared_count']}), which tandem's {arch} models do not have")
    scaling = read_metadata(path, [f"{arch}.rope.scaling.type"]).get(f"{arch}.rope.scaling.type")
    if (scaling not in (None, "none")) or "rope_freqs.weight" in types:
        raise GGUFError(f"{path} uses rope scaling ({scaling or 'rope_freqs'}), which tandem does not read "
                        "from GGUF files; serve the original Hugging Face checkpoint instead")
    return arch


def native_dtype(path: str | Path) -> str:
    """The model's own dtype: the float type of its matrices, or float32 (exact) for a quantized file."""
    matrices = {t.tensor_type.name for t in _reader(str(path)).tensors if len(t.shape) > 1}
    if len(matrices) == 1 and next(iter(matrices)) in _FLOAT_DTYPES:
        return _FLOAT_DTYPES[next(iter(matrices))]
    return "float32"


def gguf_hf_config(path: str | Path) -> dict[str, Any]:
    """The config.json (as a dict) of the model in a GGUF file; `GGUFError` if tandem cannot serve it."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    arch = check_supported(path)
    table = GGUF_CONFIG_MAPPING[_MODEL_TYPES[arch]]
    meta = read_metadata(path, [f"{arch}.{k}" for k in table] + [
        f"{arch}.attention.key_length", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.padding_token_id", f"{arch}.expert_count", f"{arch}.expert_used_count",
        f"{arch}.expert_feed_forward_length", f"{arch}.expert_weights_norm"])
    config: dict[str, Any] = {"architectures": [hf_architecture(path)], "model_type": _MODEL_TYPES[arch]}
    for key, name in table.items():
        if name is not None and f"{arch}.{key}" in meta:
            config[name] = meta[f"{arch}.{key}"]
    config.update(_moe_fields(arch, meta))
    if f"{arch}.attention.key_length" in meta:  # Qwen3's explicit head_dim
        config["head_dim"] = meta[f"{arch}.attention.key_length"]
    if "vocab_size" not in config:  # older files: the vocabulary's length
        config["vocab_size"] = len(_reader(str(path)).fields["tokenizer.ggml.tokens"].data)
    for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("padding_token_id", "pad_token_id")):
        if f"tokenizer.ggml.{key}" in meta:
            config[name] = meta[f"tokenizer.ggml.{key}"]
    config["tie_word_embeddings"] = "output.weight" not in _tensor_types(path)
    config["dtype"] = native_dtype(path)
    if arch != "llama":
        config["use_sliding_window"] = False  # GGUF files carry no window; llama.cpp attends fully
    return config


def hf_architecture(path: str | Path) -> str:
    """The HF architecture of the file's model: by `general.architecture`, Mixtral for "llama" with experts."""
    arch = _architecture(path)
    if arch == "llama" and read_metadata(path, ["llama.expert_count"]).get("llama.expert_count"):
        return MIXTRAL
    return GGUF_ARCHITECTURES[arch]


def _moe_fields(arch: str, meta: dict[str, Any]) -> dict[str, Any]:
    """The config fields of a file with experts (none for a dense one). llama.cpp's graphs renormalise
    the top-k routing weights of both families (a newer file may say so in `expert_weights_norm`); a
    Mixtral file is a "llama" whose MLPs are experts of `feed_forward_length`, attending fully."""
    experts = meta.get(f"{arch}.expert_count")
    if not experts:
        return {}
    if arch == "llama":
        return {"architectures": [MIXTRAL], "model_type": "mixtral", "num_local_experts": experts,
                "num_experts_per_tok": meta[f"{arch}.expert_used_count"], "sliding_window": None}
    fields = {"num_experts": experts, "num_experts_per_tok": meta[f"{arch}.expert_used_count"],
              "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm", True))}
    if f"{arch}.expert_feed_forward_length" in meta:
        fields["moe_intermediate_size"] = meta[f"{arch}.expert_feed_forward_length"]
    return fields


def metadata_only(path: str | Path) -> bytes:
    """The file as a GGUF with its metadata (tokenizer, chat template, config keys) and no tensors: the
    header with a tensor count of 0, then the key-value section copied byte for byte."""
    fields = list(_reader(str(path)).fields.values())
    end = fields[-1].offset + sum(int(part.nbytes) for part in fields[-1].parts)
    with open(path, "rb") as f:
        head = f.read(end)
    # magic (4) + version (4) + tensor count (8, zero in either byte order) + key-value count (8) + pairs
    return head[:8] + bytes(8) + head[16:]


def _name_table(path: str | Path, names: Iterable[str], num_layers: int) -> dict[str, list[tuple[int | None, str]]]:
    """GGUF tensor name -> [(expert index or None, HF checkpoint name)], for the HF names wanted (gguf-py's
    name map). A file holds each layer's experts stacked in one tensor (`blk.N.ffn_gate_exps`: [E, ...]);
    an HF checkpoint names one tensor per expert (`...experts.{e}.gate_proj`), slice e of it."""
    import gguf

    arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[_architecture(path)]
    name_map = gguf.get_tensor_name_map(arch, num_layers)
    table: dict[str, list[tuple[int | None, str]]] = {}
    for hf_name in names:
        base, _, suffix = hf_name.rpartition(".")
        expert = _EXPERT.match(base)
        index = int(expert.group(2)) if expert else None
        gguf_base = name_map.get_name(f"{expert.group(1)}.{expert.group(3)}" if expert else base)
        if gguf_base is not None:
            table.setdefault(f"{gguf_base}.{suffix}", []).append((index, hf_name))
    return table


def _unpermute_qk(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: per head, rows (pairs interleaved) -> (first half, second half)."""
    shape = weights.shape
    return weights.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def iter_gguf_weights(path: str | Path, names: Iterable[str], dtype: Any) -> Iterator[tuple[str, Any]]:
    """(HF checkpoint name, torch tensor in `dtype`) for every file tensor that maps to one of `names`.

    Tensors of the file that map to no wanted name are skipped (the caller reports names never given).
    """
    import torch
    from gguf.quants import dequantize

    arch = check_supported(path)
    meta = read_metadata(path, [f"{arch}.block_count", f"{arch}.attention.head_count",
                                f"{arch}.attention.head_count_kv"])
    heads = int(meta[f"{arch}.attention.head_count"])
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    table = _name_table(path, names, int(meta[f"{arch}.block_count"]))
    for tensor in _reader(str(path)).tensors:
        targets = table.get(tensor.name)
        if targets is None:
            continue
        weights = dequantize(tensor.data, tensor.tensor_type)
        weights = weights.reshape(tuple(int(d) for d in reversed(tensor.shape)))  # ggml order is reversed
        if arch in _PERMUTED_QK_ARCHS and ".attn_q." in tensor.name:
            weights = _unpermute_qk(weights, heads)
        elif arch in _PERMUTED_QK_ARCHS and ".attn_k." in tensor.name:
            weights = _unpermute_qk(weights, kv_heads)
        for index, hf_name in targets:
            part = weights if index is None else weights[index]
            if not part.flags.writeable:  # a plain-float tensor is a view of the read-only file map
                part = part.copy()
            yield hf_name, torch.from_numpy(np.ascontiguousarray(part)).to(dtype)
