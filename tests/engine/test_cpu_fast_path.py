"""The CPU fast path: oneDNN linears on weights prepacked at load, and a bfloat16 forward that never
converts activations to float32. The torch reference path (`TANDEM_CPU_PREPACK=0`) stays tested against
transformers too."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine_svc.attention.torch_backend import TorchAttentionBackend
from engine_svc.config import EngineConfig
from engine_svc.model.layers.cpu_gemm import PREPACK_ENV, PackedWeight, prepack_linears, prepack_supported
from engine_svc.model.loader import load_model
from engine_svc.worker.worker import Worker
from entrypoints import LLM, SamplingParams
from tests.engine.test_hf_exact import make_prompts, run_and_compare

CPU = torch.device("cpu")


def _packable(model: torch.nn.Module) -> list[PackedWeight]:
    return [m for m in model.modules() if isinstance(m, PackedWeight)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linears_compute_what_f_linear_computes(make_model, dtype: torch.dtype) -> None:
    if not prepack_supported(dtype, CPU):
        pytest.skip(f"oneDNN has no {dtype} linear on this CPU")
    model_dir = make_model("qwen2", tie_word_embeddings=True)  # q/k/v biases go through the packed op too
    plain = load_model(model_dir, dtype, CPU, TorchAttentionBackend())
    packed = load_model(model_dir, dtype, CPU, TorchAttentionBackend())
    assert prepack_linears(packed) == len(_packable(packed)) == 4 * 2 + 1  # qkv, o, gate_up, down per layer + head
    for module in _packable(packed):
        assert module.packed is not None
    layer = packed.model.layers[0]
    assert layer.mlp.gate_up_proj.weight.numel() == 0  # the plain copy is dropped ...
    assert packed.is_tied and packed.model.embed_tokens.weight.numel() > 0  # ... unless the embedding shares it

    x = torch.randn(5, plain.config.hidden_size).to(dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.down_proj"):
        a, b = plain.model.layers[0].get_submodule(name), layer.get_submodule(name)
        inp = torch.randn(5, a.in_features).to(dtype)
        torch.testing.assert_close(b(inp), a(inp), **tol)
    torch.testing.assert_close(packed.compute_logits(x), plain.compute_logits(x), **tol)


def test_the_worker_prepacks_on_cpu_unless_switched_off(llama_dir, monkeypatch) -> None:
    config = EngineConfig.create(model=str(llama_dir), dtype="float32", device="cpu")
    worker = Worker(config)
    worker.load_model()
    assert all(m.packed is not None for m in _packable(worker.model))
    assert worker.model.lm_head.weight.numel() == 0  # an untied head keeps only its packed copy
    monkeypatch.setenv(PREPACK_ENV, "0")
    reference = Worker(config)
    reference.load_model()
    assert all(m.packed is None for m in _packable(reference.model))


def test_the_torch_reference_path_still_equals_transformers(make_model, monkeypatch) -> None:
    monkeypatch.setenv(PREPACK_ENV, "0")
    run_and_compare(make_model("llama"), make_prompts(11, 4, 500))


class _Float32Outputs(TorchDispatchMode):
    """Records every op that returns a float32 tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        results = out if isinstance(out, (tuple, list)) else (out,)
        if any(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in results):
            self.ops.append(str(func))
        return out


def test_a_bfloat16_forward_converts_nothing_to_float32(make_model) -> None:
    """Prefill chunks and decodes of a bf16 model: every activation, norm, rotation and attention stays
    in bf16 (RMSNorm and SDPA accumulate in float32 inside their kernels); only the logits are float32."""
    llm = LLM(str(make_model("qwen3")), dtype="bfloat16", max_num_batched_tokens=16, block_size=8)
    model: Any = llm.engine.executor.worker.model  # type: ignore[attr-defined]
    seen = _Float32Outputs()
    inner = model.forward

    def watched(*args: Any, **kwargs: Any) -> Any:
        with seen:
            return inner(*args, **kwargs)

    model.forward = watched
    prompts = make_prompts(12, 5, 500, lo=5, hi=30)  # chunked prefills, prefills with context, decodes
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    assert seen.ops == []
    llm.engine.shutdown()
