"""Mixture-of-experts models from GGUF files (engine_svc/model/gguf.py): Qwen3-MoE ("qwen3moe") and
Mixtral (a "llama" file with experts).

The files are written here from tiny random HF checkpoints the way llama.cpp's converter writes them:
its metadata keys, its tensor names (gguf-py's table), each layer's experts stacked in one tensor, and
the q/k rows of "llama" files permuted. transformers' own GGUF loader reads them back to the HF model's
logits (so the files are what llama.cpp users have), and tandem's model loaded from the file equals the
one loaded from the checkpoint, parameter for parameter (which equals transformers: test_moe_model.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file

from engine_svc.attention.torch_backend import TorchAttentionBackend
from engine_svc.config import ConfigError, EngineConfig
from engine_svc.model.loader import load_config, load_model

EXPERT_TENSORS = {"qwen3moe": ("mlp.experts", ("gate_proj", "up_proj", "down_proj")),
                  "llama": ("block_sparse_moe.experts", ("w1", "w3", "w2"))}


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: q/k rows interleaved for llama.cpp's rotary layout."""
    shape = weights.shape
    return weights.reshape(num_heads, 2, shape[0] // num_heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def write_gguf(hf_dir: Path, path: Path, arch: str, **extra_metadata: int) -> Path:
    """The checkpoint in `hf_dir` as a float32 GGUF file of architecture `arch`, as llama.cpp writes it."""
    import gguf

    config = json.loads((hf_dir / "config.json").read_text())
    tensors = {k: v.float().numpy() for k, v in load_file(next(hf_dir.glob("*.safetensors"))).items()}
    layers, heads, kv_heads = config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(config.get("head_dim") or config["hidden_size"] // heads)
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"] if "rope_parameters" in config
                              else config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    num_experts = config.get("num_experts") or config["num_local_experts"]  # (transformers 5: the latter)
    writer.add_expert_count(num_experts)
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    for key, value in extra_metadata.items():
        writer.add_uint32(f"{arch}.{key}", value)

    name_map = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], layers)
    prefix, projections = EXPERT_TENSORS[arch]
    out: dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        if f".{prefix}." in name:
            continue
        base, _, suffix = name.rpartition(".")
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            value = llama_cpp_permute(value, heads if base.endswith("q_proj") else kv_heads)
        out[f"{name_map.get_name(base)}.{suffix}"] = value
    for layer in range(layers):
        for projection in projections:
            stacked = np.stack([tensors[f"model.layers.{layer}.{prefix}.{e}.{projection}.weight"]
                                for e in range(num_experts)])
            out[f"{name_map.get_name(f'model.layers.{layer}.{prefix}.{projection}')}.weight"] = stacked
    for name, value in out.items():
        writer.add_tensor(name, np.ascontiguousarray(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def gguf_pairs(make_model, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """arch -> (HF checkpoint dir, the same model as a GGUF file)."""
    root = tmp_path_factory.mktemp("moe_gguf")
    pairs = {}
    for hf_arch, gguf_arch in (("qwen3_moe", "qwen3moe"), ("mixtral", "llama")):
        hf_dir = make_model(hf_arch)
        pairs[hf_arch] = (hf_dir, write_gguf(hf_dir, root / f"{hf_arch}.gguf", gguf_arch))
    return pairs


def test_transformers_reads_the_written_file_as_the_checkpoint(gguf_pairs) -> None:
    """The writer's files are llama.cpp's: transformers' GGUF loader gives the checkpoint's logits. (It
    reads no Mixtral file: "llama" files with experts are unknown to it; their q/k permutation is the dense
    llama's, checked against transformers on SmolLM2's file in tests/realmodel/test_gguf.py, and their
    stacked experts are laid out as Qwen3-MoE's, checked here.)"""
    hf_dir, path = gguf_pairs["qwen3_moe"]
    ids = torch.tensor([[5, 17, 99, 3, 250, 41, 8]])
    with torch.no_grad():
        want = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)(ids).logits
        got = transformers.AutoModelForCausalLM.from_pretrained(  # (its GGUF config table lacks a few keys)
            path.parent, gguf_file=path.name, config=transformers.AutoConfig.from_pretrained(hf_dir),
            dtype=torch.float32)(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_a_moe_gguf_file_loads_the_checkpoints_model(gguf_pairs, arch: str) -> None:
    hf_dir, path = gguf_pairs[arch]
    from_file, from_dir = load_config(path), load_config(hf_dir)
    assert from_file.architectures == from_dir.architectures
    for field in ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "norm_topk_prob", "intermediate_size", "hidden_size", "head_dim", "num_key_value_heads"):
        assert getattr(from_file, field, None) == getattr(from_dir, field, None), field
    ours = load_model(path, torch.float32, "cpu", TorchAttentionBackend()).state_dict()
    reference = load_model(hf_dir, torch.float32, "cpu", TorchAttentionBackend()).state_dict()
    assert ours.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(ours[name], tensor), name
    EngineConfig.create(model=str(path))  # accepted at start


def test_a_file_with_shared_experts_is_refused_by_name(gguf_pairs, tmp_path: Path) -> None:
    hf_dir, _ = gguf_pairs["qwen3_moe"]
    path = write_gguf(hf_dir, tmp_path / "shared.gguf", "qwen3moe", expert_shared_count=1)
    with pytest.raises(ConfigError, match=r"shared experts \(qwen3moe.expert_shared_count = 1\)"):
        EngineConfig.create(model=str(path))
