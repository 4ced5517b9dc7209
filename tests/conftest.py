"""Suite-wide fixtures: tiny random-weight models built locally (nothing can be downloaded).

Triton kernels run on CPU through the interpreter, which must be switched on before triton is
imported anywhere in the process.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ARCHS = ("llama", "mistral", "qwen2", "qwen3")

# Small, but with enough heads for GQA; qwen2 is MQA (one KV head); qwen3 has head_dim != hidden/heads.
TINY_SHAPES: dict[str, dict[str, int]] = {
    "llama": dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2),
    "mistral": dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2),
    "qwen2": dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=1),
    "qwen3": dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32),
}


@pytest.fixture(scope="session")
def tiny_model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def make_model(tiny_model_root: Path):
    """Build (once per session) a tiny model of an architecture; returns its directory."""
    from engine_svc.tiny_model import make_tiny_model

    cache: dict[tuple, Path] = {}

    def build(arch: str = "llama", seed: int = 0, **overrides: int) -> Path:
        shape = {**TINY_SHAPES[arch], **overrides}
        key = (arch, seed, tuple(sorted(shape.items())))
        if key not in cache:
            name = f"{arch}-{seed}-" + "-".join(f"{k}{v}" for k, v in sorted(shape.items()))
            cache[key] = make_tiny_model(tiny_model_root / name, arch=arch, seed=seed, vocab_size=512, **shape)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def llama_dir(make_model) -> Path:
    return make_model("llama")
