"""LoRA on a real GPU: the PEFT oracle of tests/engine/test_lora_peft_exact.py on CUDA with the Triton
backend, the Triton shrink/expand kernels and decode CUDA graphs (captured with LoRA enabled), float32: a
batch of the base model and four adapters, tokens exact and logprobs within 1e-4, with two slots for four
adapters (swaps between steps, replayed by the same graphs); and graph replays equal eager steps."""

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


def _generate(model_dir, dirs, assignment, prompts, enforce_eager: bool):
    from entrypoints import LLM, LoRARequest, SamplingParams
    from kernels import lora_expand, lora_shrink

    llm = LLM(str(model_dir), dtype="float32", device="cuda", attention_backend="triton", enable_lora=True,
              max_lora_rank=16, max_loras=2, lora_modules={name: str(path) for name, path in dirs.items()},
              max_model_len=128, max_num_seqs=8, enforce_eager=enforce_eager)
    launches = lora_shrink._kernel.launches, lora_expand._kernel.launches
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (20, 7, 15, 3, 20, 11)]
    outs = llm.generate(prompts, params, use_tqdm=False,
                        lora_request=[LoRARequest(name) if name else None for name in assignment])
    runner = llm.engine.executor.worker.runner
    graphs = runner.cuda_graphs
    assert runner.lora is not None and runner.lora.graph_safe  # the kernel path, on CUDA
    assert lora_shrink._kernel.launches > launches[0] and lora_expand._kernel.launches > launches[1]
    tokens = [o.outputs[0].token_ids for o in outs]
    replays = 0 if graphs is None else graphs.num_replays
    llm.engine.shutdown()
    return tokens, graphs, replays


def test_lora_graph_replays_equal_eager_steps(lora_setup) -> None:  # noqa: F811
    """Mixed adapters (and the base) through two slots: decode steps replay the graphs captured with LoRA
    enabled, adapters are swapped into the slots between replays, and the tokens equal eager steps'."""
    model_dir, dirs = lora_setup
    assignment = [None, "all7", "qv-rs", "mlp16", "ku2", "all7"]
    prompts = make_prompts(4, len(assignment), 500)
    eager, no_graphs, _ = _generate(model_dir, dirs, assignment, prompts, enforce_eager=True)
    graph, graphs, replays = _generate(model_dir, dirs, assignment, prompts, enforce_eager=False)
    assert no_graphs is None and graphs is not None and replays > 0
    assert graph == eager
