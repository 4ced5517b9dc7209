"""LoRA on a real GPU: the PEFT oracle of tests/engine/test_lora_peft_exact.py on CUDA with the Triton
backend (fused kernels after the qkv projection's LoRA delta; LoRA steps run eagerly, without CUDA graphs),
float32: a batch of the base model and four adapters, tokens exact and logprobs within 1e-4, with two
slots for four adapters (swaps between steps)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.lora_support import make_prompts
from tests.engine.test_lora_peft_exact import lora_setup, run_mixed  # noqa: F401 (a fixture)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("max_loras", [4, 2])
def test_mixed_adapters_on_cuda_equal_peft(lora_setup, max_loras: int) -> None:  # noqa: F811
    model_dir, dirs = lora_setup
    assignment = [None, "all7", "qv-rs", "mlp16", "ku2", "all7", None, "qv-rs"]
    run_mixed(model_dir, dirs, assignment, make_prompts(3, len(assignment), 500), max_loras=max_loras,
              device="cuda", attention_backend="triton", max_model_len=128, max_num_seqs=8)
