"""The LoRA oracle: PEFT. One batch mixes the base model and four adapters (ranks 2-16, different target
modules, rsLoRA on one); every completion's greedy tokens equal the PEFT model's of its adapter, and its
logprobs agree within 1e-4 (float32), with chunked prefill, prefix caching and fewer device slots than
adapters (slots swap between steps)."""

from __future__ import annotations

from pathlib import Path

import pytest

from entrypoints import LLM, LoRARequest, SamplingParams
from tests.engine.lora_support import ALL_MODULES, make_adapter, make_prompts, peft_greedy

MAX_TOKENS = 8
ADAPTERS = {  # name -> (rank, alpha, targets, rslora)
    "all7": (8, 16, ALL_MODULES, False),
    "qv-rs": (4, 8, ("q_proj", "v_proj"), True),
    "mlp16": (16, 32, ("o_proj", "gate_proj", "down_proj"), False),
    "ku2": (2, 4, ("k_proj", "up_proj"), False),
}


@pytest.fixture(scope="module")
def lora_setup(make_model, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    model_dir = make_model("llama")
    root = tmp_path_factory.mktemp("adapters")
    dirs = {name: make_adapter(model_dir, root / name, rank=r, alpha=a, targets=t, rslora=rs, seed=i)
            for i, (name, (r, a, t, rs)) in enumerate(ADAPTERS.items())}
    return model_dir, dirs


def run_mixed(model_dir: Path, dirs: dict[str, Path], assignment: list[str | None], prompts: list[list[int]],
              **engine_args) -> LLM:
    llm = LLM(str(model_dir), dtype="float32", enable_lora=True, max_lora_rank=16,
              lora_modules={name: str(path) for name, path in dirs.items()}, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    requests = [LoRARequest(name) if name else None for name in assignment]
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
    for prompt, name, out in zip(prompts, assignment, outs):
        expected, expected_lp = peft_greedy(model_dir, dirs[name] if name else None, prompt, MAX_TOKENS)
        got = out.outputs[0]
        assert got.token_ids == expected, f"adapter {name}, prompt length {len(prompt)}"
        assert [e.logprob for e in got.logprobs] == pytest.approx(expected_lp, abs=1e-4), name
    stats = llm.engine.get_stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == llm.engine.num_blocks
    llm.engine.shutdown()
    return llm


def test_mixed_batch_of_four_adapters_and_base_equals_peft(lora_setup) -> None:
    model_dir, dirs = lora_setup
    assignment = [None, "all7", "qv-rs", "mlp16", "ku2", "all7", None, "qv-rs"]
    run_mixed(model_dir, dirs, assignment, make_prompts(3, len(assignment), 500), max_loras=4)


def test_adapters_change_the_output(lora_setup) -> None:
    """The oracle comparison above is only meaningful if the adapters move the tokens."""
    model_dir, dirs = lora_setup
    prompt = make_prompts(5, 1, 500, lo=20, hi=20)[0]
    outs = {name: tuple(peft_greedy(model_dir, dirs[name] if name else None, prompt, MAX_TOKENS)[0])
            for name in (None, *ADAPTERS)}
    assert len(set(outs.values())) == len(outs)


def test_fewer_slots_than_adapters_chunked_and_prefix_cached(lora_setup) -> None:
    """max_loras=2 with four adapters in line: the scheduler holds at most two per step and the worker
    swaps adapters through its two slots; a 16-token budget chunks the prompts; the same prompt under
    every adapter (and the base) hits no other adapter's cached blocks."""
    model_dir, dirs = lora_setup
    shared = make_prompts(7, 1, 500, lo=40, hi=40)[0]
    assignment = [None, "all7", "qv-rs", "mlp16", "ku2", None, "ku2", "all7"]
    prompts = [shared] * 5 + make_prompts(8, 3, 500)
    run_mixed(model_dir, dirs, assignment, prompts, max_loras=2, max_num_batched_tokens=16,
              long_prefill_token_threshold=0)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tensor_parallel_two_ranks_equal_peft(make_model, tmp_path_factory: pytest.TempPathFactory,
                                              arch: str) -> None:
    """TP=2 over gloo: column layers hold B's output-row shards, row layers A's input-column shards (qwen2:
    one KV head replicated on both ranks, qkv bias); the mixed batch still equals PEFT."""
    model_dir = make_model(arch)
    root = tmp_path_factory.mktemp(f"tp-adapters-{arch}")
    dirs = {name: make_adapter(model_dir, root / name, rank=r, alpha=a, targets=t, rslora=rs, seed=30 + i)
            for i, (name, (r, a, t, rs)) in enumerate(ADAPTERS.items()) if name in ("all7", "qv-rs")}
    assignment = ["all7", None, "qv-rs", "all7"]
    run_mixed(model_dir, dirs, assignment, make_prompts(9, len(assignment), 500), max_loras=2,
              tensor_parallel_size=2, device="cpu")


@pytest.mark.parametrize("arch", ["qwen3", "mixtral"])
def test_other_architectures_equal_peft(make_model, tmp_path_factory: pytest.TempPathFactory, arch: str) -> None:
    """qwen3 (q/k norms, head_dim != hidden / heads) on all seven projections; mixtral (a mixture of
    experts: no dense MLP, so attention projections only). Mixtral's adapters are smaller (scale 0.15): at
    0.3 its router amplifies float32 rounding to 1.05e-4 on one logprob (tokens still equal)."""
    model_dir = make_model(arch)
    root = tmp_path_factory.mktemp(f"adapters-{arch}")
    targets = ALL_MODULES if arch == "qwen3" else ("q_proj", "k_proj", "v_proj", "o_proj")
    scale = 0.3 if arch == "qwen3" else 0.15
    dirs = {"x": make_adapter(model_dir, root / "x", rank=8, alpha=16, targets=targets, seed=40, scale=scale),
            "y": make_adapter(model_dir, root / "y", rank=2, alpha=8, targets=targets[:2], seed=41, rslora=True,
                              scale=scale)}
    assignment = ["x", None, "y", "x"]
    run_mixed(model_dir, dirs, assignment, make_prompts(13, len(assignment), 500), max_loras=2)
