"""LoRA adapters loaded and unloaded at run time (engine_svc/lora/registry.py), against PEFT: a loaded
adapter's greedy tokens and logprobs equal PEFT's; an adapter unloaded mid-request finishes that request
exactly and refuses new ones; a name loaded again with other weights never reuses the old weights' KV
(prefix caching on); --max-cpu-loras, duplicates, unknown names and bad directories are refused and change
nothing; every block comes back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine_svc.lora.peft_dir import LoRAAdapterError, validate_for_model
from engine_svc.lora.registry import LoRARegistryError
from entrypoints import LLM, LoRARequest, SamplingParams
from shared_runtime.contract import EngineCoreRequest, EngineSamplingParams
from tests.engine.lora_support import ALL_MODULES, make_adapter, make_prompts, peft_greedy

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(make_model, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    model_dir = make_model("llama")
    root = tmp_path_factory.mktemp("runtime-adapters")
    return model_dir, {
        "x": make_adapter(model_dir, root / "x", rank=8, alpha=16, targets=ALL_MODULES, seed=31),
        "y": make_adapter(model_dir, root / "y", rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"),
                          seed=32, rslora=True),
        "z": make_adapter(model_dir, root / "z", rank=2, alpha=4, targets=("o_proj", "up_proj"), seed=33),
    }


def _llm(model_dir: Path, **args) -> LLM:
    return LLM(str(model_dir), dtype="float32", enable_lora=True, max_lora_rank=8, **args)


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


def _assert_peft(model_dir: Path, adapter: Path | None, prompt: list[int], out) -> None:
    tokens, logprobs = peft_greedy(model_dir, adapter, prompt, MAX_TOKENS)
    assert out.outputs[0].token_ids == tokens
    assert [e.logprob for e in out.outputs[0].logprobs] == pytest.approx(logprobs, abs=1e-4)


def _engine_request(rid: str, prompt: list[int], lora: str) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, lora_name=lora,
                             sampling_params=EngineSamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                                  ignore_eos=True))


def _all_blocks_back(llm: LLM) -> None:
    stats = llm.engine.get_stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == llm.engine.num_blocks


def test_loaded_at_run_time_equals_peft_beside_the_base_and_a_static_adapter(adapters) -> None:
    model_dir, dirs = adapters
    llm = _llm(model_dir, max_loras=2, lora_modules={"x": str(dirs["x"])})
    prompts = make_prompts(41, 4, 500)
    requests = [LoRARequest("y", lora_path=str(dirs["y"])), LoRARequest("x"), None, LoRARequest("y")]
    outs = llm.generate(prompts, _greedy(), use_tqdm=False, lora_request=requests)
    for prompt, name, out in zip(prompts, ["y", "x", None, "y"], outs):
        _assert_peft(model_dir, dirs[name] if name else None, prompt, out)
    assert [(a.name, a.lora_id) for a in llm.engine.loras.served()] == [("x", 1), ("y", 2)]
    _all_blocks_back(llm)
    llm.engine.shutdown()


def test_unload_mid_request_finishes_it_exactly_refuses_new_ones_and_drops_the_weights(adapters) -> None:
    model_dir, dirs = adapters
    llm = _llm(model_dir)
    core, registry = llm.engine, llm.engine.loras
    registry.add("y", str(dirs["y"]))
    prompt = make_prompts(42, 1, 500, lo=12, hi=12)[0]
    core.add_request(_engine_request("victim", prompt, "y"))
    outputs: dict[str, list[int]] = {"victim": []}
    errors = {}
    for _ in range(3):
        for o in core.step().outputs:
            outputs[o.request_id].extend(o.new_token_ids)
    registry.remove("y")  # mid-request
    worker_lora = core.executor.worker.runner.lora
    assert 1 in worker_lora.host  # still held: the victim runs under it
    core.add_request(_engine_request("late", prompt, "y"))
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            if o.error is not None:
                errors[o.request_id] = o.error.message
            else:
                outputs[o.request_id].extend(o.new_token_ids)
    assert outputs["victim"] == peft_greedy(model_dir, dirs["y"], prompt, MAX_TOKENS)[0]
    assert "unknown LoRA adapter 'y'" in errors["late"]
    core.add_request(_engine_request("base", prompt, ""))  # one more step carries the drop
    while core.has_unfinished_requests():
        core.step()
    assert worker_lora.host == {} and registry.served() == []
    _all_blocks_back(llm)
    core.shutdown()


def test_a_name_loaded_again_runs_the_new_weights_and_never_their_old_kv(adapters) -> None:
    """load_inplace: the same name, other weights, the same prompt with prefix caching on: PEFT of the new
    adapter (the id, not only the name, keys the prefix cache)."""
    model_dir, dirs = adapters
    llm = _llm(model_dir, enable_prefix_caching=True, block_size=4)
    prompt = make_prompts(43, 1, 500, lo=24, hi=24)[0]
    first = llm.generate([prompt], _greedy(), use_tqdm=False, lora_request=LoRARequest("a", lora_path=str(dirs["x"])))
    _assert_peft(model_dir, dirs["x"], prompt, first[0])
    with pytest.raises(LoRARegistryError, match="has already been loaded") as info:
        llm.engine.loras.add("a", str(dirs["z"]))
    assert info.value.kind == "exists"
    llm.engine.loras.add("a", str(dirs["z"]), replace=True)
    second = llm.generate([prompt], _greedy(), use_tqdm=False, lora_request=LoRARequest("a"))
    _assert_peft(model_dir, dirs["z"], prompt, second[0])
    assert first[0].outputs[0].token_ids != second[0].outputs[0].token_ids
    _all_blocks_back(llm)
    llm.engine.shutdown()


def test_max_cpu_loras_unknown_names_and_bad_directories_are_refused_and_change_nothing(adapters, tmp_path) -> None:
    model_dir, dirs = adapters
    llm = _llm(model_dir, max_loras=1, max_cpu_loras=2)
    registry, cfg = llm.engine.loras, llm.config
    registry.add("x", str(dirs["x"]))
    registry.add("y", str(dirs["y"]))
    with pytest.raises(LoRARegistryError, match=r"--max-cpu-loras \(2\)") as info:
        registry.add("z", str(dirs["z"]))
    assert info.value.kind == "capacity"
    with pytest.raises(LoRARegistryError, match="'nope' cannot be found") as info:
        registry.remove("nope")
    assert info.value.kind == "not_found"
    assert [a.name for a in registry.served()] == ["x", "y"]
    registry.remove("x")  # unused: its place is free at once
    assert registry.add("z", str(dirs["z"])).lora_id == 3
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 16, "lora_alpha": 8}))
    with pytest.raises(LoRAAdapterError, match="above --max-lora-rank 8"):
        validate_for_model(cfg.model, cfg.architecture, cfg.max_lora_rank, "bad", str(bad))
    with pytest.raises(ValueError, match="above --max-lora-rank 8"):
        llm.generate([[5, 6, 7]], _greedy(), use_tqdm=False, lora_request=LoRARequest("bad", lora_path=str(bad)))
    assert [a.name for a in registry.served()] == ["y", "z"]
    outs = llm.generate([[5, 6, 7]], _greedy(), use_tqdm=False, lora_request=LoRARequest("z"))
    _assert_peft(model_dir, dirs["z"], [5, 6, 7], outs[0])
    llm.engine.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_tensor_parallel_ranks_load_and_replace_through_the_step(adapters) -> None:
    """TP=2 over gloo (worker processes): the load travels in the SchedulerOutput to both ranks, each lays
    out its shard; replaced in place, the new weights run; all equal PEFT."""
    model_dir, dirs = adapters
    llm = _llm(model_dir, max_loras=2, tensor_parallel_size=2, device="cpu")
    prompts = make_prompts(44, 3, 500)
    outs = llm.generate(prompts, _greedy(), use_tqdm=False,
                        lora_request=[LoRARequest("d", lora_path=str(dirs["x"])), None, LoRARequest("d")])
    for prompt, adapter, out in zip(prompts, [dirs["x"], None, dirs["x"]], outs):
        _assert_peft(model_dir, adapter, prompt, out)
    outs = llm.generate(prompts[:1], _greedy(), use_tqdm=False, lora_request=LoRARequest("d", lora_path=str(dirs["y"])))
    _assert_peft(model_dir, dirs["y"], prompts[0], outs[0])
    _all_blocks_back(llm)
    llm.engine.shutdown()


def test_a_mixture_of_experts_model_takes_attention_adapters_only(make_model, tmp_path) -> None:
    """The engine process checks a run-time adapter against the model's config as the workers attach
    slots: mixtral has no dense MLP, so an MLP target is refused before anything changes."""
    model_dir = make_model("mixtral")
    attn = make_adapter(model_dir, tmp_path / "attn", rank=4, alpha=8, targets=("q_proj", "v_proj"), seed=45,
                        scale=0.15)
    llm = _llm(model_dir)
    cfg = llm.config
    mlp_keys = {"base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight"}
    with pytest.raises(LoRAAdapterError, match="targets gate_proj, which this model lacks"):
        _refuse_mlp(cfg, tmp_path, attn, mlp_keys)
    prompt = make_prompts(45, 1, 500)[0]
    outs = llm.generate([prompt], _greedy(), use_tqdm=False, lora_request=LoRARequest("a", lora_path=str(attn)))
    _assert_peft(model_dir, attn, prompt, outs[0])
    llm.engine.shutdown()


def _refuse_mlp(cfg, tmp_path: Path, attn: Path, keys: set[str]) -> None:
    """`attn`'s adapter plus an MLP tensor, checked for `cfg`'s model."""
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "with-mlp"
    shutil.copytree(attn, bad)
    weights = load_file(str(bad / "adapter_model.safetensors"))
    hidden = next(iter(weights.values())).shape[1]
    weights.update({key: weights[next(iter(weights))].new_zeros(4, hidden) for key in keys})
    save_file(weights, str(bad / "adapter_model.safetensors"))
    validate_for_model(cfg.model, cfg.architecture, cfg.max_lora_rank, "with-mlp", str(bad))
