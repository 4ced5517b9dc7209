"""The Ray executor on CUDA: a placement group of one {"GPU": 1} bundle, the actor's worker on the one GPU
Ray makes visible to it (ray_worker.RayCudaWorker), greedy tokens and logprobs equal to the in-process
executor's on the same GPU. Needs `ray` installed where the GPU is (the `ray` extra)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_ray_on_one_gpu_equals_the_in_process_executor(llama_dir: Path) -> None:
    from engine_svc.executor.ray_executor import RayExecutor
    from entrypoints import LLM, SamplingParams
    from tests.engine.test_hf_exact import make_prompts

    args = dict(dtype="float32", device="cuda", attention_backend="triton", max_model_len=128, block_size=16,
                num_gpu_blocks_override=64, max_num_seqs=4, enforce_eager=True)
    prompts = make_prompts(3, 4, 500, lo=8, hi=40)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    ray.init(address="local", num_gpus=1, include_dashboard=False)
    try:
        on_ray = LLM(str(llama_dir), distributed_executor_backend="ray", **args)
        assert isinstance(on_ray.engine.executor, RayExecutor)
        got = on_ray.generate(prompts, params, use_tqdm=False)
        on_ray.engine.shutdown()
    finally:
        ray.shutdown()
    here = LLM(str(llama_dir), **args)
    want = here.generate(prompts, params, use_tqdm=False)
    here.engine.shutdown()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for g, w in zip(got, want, strict=True):
        assert [e.logprob for e in g.outputs[0].logprobs] == pytest.approx([e.logprob for e in w.outputs[0].logprobs],
                                                                           abs=1e-5)
