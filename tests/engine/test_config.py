"""EngineConfig rejects bad arguments with messages that say what is wrong and what to do."""

from __future__ import annotations

import json

import pytest

from engine_svc.config import ConfigError, EngineConfig


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"block_size": 12}, "--block-size 12 must be a power of two"),
        ({"block_size": 16, "max_num_batched_tokens": 8}, "smaller than --block-size 16"),
        ({"dtype": "float64"}, "--dtype 'float64' is not supported; choose one of auto, float32"),
        ({"device": "tpu"}, "--device 'tpu' is not supported"),
        ({"scheduling_policy": "lifo"}, "--scheduling-policy 'lifo' is not supported"),
        ({"attention_backend": "flash"}, "--attention-backend 'flash' is not supported"),
        ({"max_num_seqs": 0}, "--max-num-seqs must be >= 1"),
        ({"long_prefill_token_threshold": -1}, "--long-prefill-token-threshold must be >= 0"),
        ({"gpu_memory_utilization": 1.5}, "--gpu-memory-utilization must be in (0, 1]"),
        ({"max_model_len": 10**6}, "exceeds the model's max_position_embeddings"),
        ({"bogus": 1}, "unknown engine argument(s): bogus"),
    ],
)
def test_bad_arguments_are_explained(llama_dir, args: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        EngineConfig.create(model=str(llama_dir), **args)
    assert message in str(err.value)


def test_model_dir_must_exist_and_hold_config_json(tmp_path) -> None:
    with pytest.raises(ConfigError, match="is not a directory"):
        EngineConfig.create(model=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        EngineConfig.create(model=str(tmp_path))


def test_unsupported_architecture_names_the_supported_ones(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match=r"unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        EngineConfig.create(model=str(tmp_path))


def test_defaults_follow_the_model_and_device(llama_dir) -> None:
    cfg = EngineConfig.create(model=str(llama_dir), device="cpu")
    assert cfg.max_model_len == 2048  # the tiny model's max_position_embeddings
    # CPU: short steps, long prompts prefilled 64 tokens a step beside decodes; CUDA: vLLM's defaults
    assert (cfg.max_num_batched_tokens, cfg.long_prefill_token_threshold) == (256, 64)
    assert EngineConfig.create(model=str(llama_dir), device="cpu", max_num_seqs=512).max_num_batched_tokens == 512
    gpu = EngineConfig.create(model=str(llama_dir), device="cuda")
    assert (gpu.max_num_batched_tokens, gpu.long_prefill_token_threshold) == (8192, 0)
    from engine_svc.config import cpu_bf16_is_faster

    assert cfg.torch_dtype_name == ("bfloat16" if cpu_bf16_is_faster() else "float32")  # a float32 model
    assert cfg.resolved_attention_backend == "torch"
    assert cfg.enable_prefix_caching and cfg.architecture == "LlamaForCausalLM"
    with pytest.raises(AttributeError):
        cfg.block_size = 32  # type: ignore[misc]  # frozen


def test_async_scheduling_flag_and_its_default_by_device(llama_dir) -> None:
    import argparse

    from engine_svc.config import ASYNC_SCHEDULING_DEFAULT, add_engine_args, config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for flags, expected in (([], ASYNC_SCHEDULING_DEFAULT["cpu"]), (["--async-scheduling"], True),
                            (["--no-async-scheduling"], False)):
        cfg = config_from_args(parser.parse_args(["--model", str(llama_dir), "--device", "cpu", *flags]))
        assert cfg.resolved_async_scheduling is expected
    gpu = EngineConfig.create(model=str(llama_dir), device="cuda")
    assert gpu.async_scheduling is None and gpu.resolved_async_scheduling is ASYNC_SCHEDULING_DEFAULT["cuda"]


def test_cuda_without_a_gpu_is_a_clear_startup_error(llama_dir) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from entrypoints import LLM

    with pytest.raises(RuntimeError, match="CUDA is not available"):
        LLM(str(llama_dir), device="cuda")


def test_a_sliding_window_frees_kv_when_every_layer_shares_it(llama_dir, tmp_path) -> None:
    """The window no longer caps the context (the attention applies it); the KV cache frees blocks behind
    it only when every layer slides over the same window (engine_svc/model/windows.py)."""
    import shutil

    model = tmp_path / "windowed"
    shutil.copytree(llama_dir, model)
    config = json.loads((model / "config.json").read_text())

    def create(**fields):
        (model / "config.json").write_text(json.dumps({**config, **fields}))
        return EngineConfig.create(model=str(model))

    mistral = create(architectures=["MistralForCausalLM"], sliding_window=512)
    assert (mistral.max_model_len, mistral.kv_sliding_window) == (2048, 512)
    assert create(architectures=["LlamaForCausalLM"], sliding_window=512).kv_sliding_window is None
    qwen2 = dict(architectures=["Qwen2ForCausalLM"], sliding_window=512, num_hidden_layers=2)
    assert create(**qwen2, use_sliding_window=False).kv_sliding_window is None
    assert create(**qwen2, use_sliding_window=True, max_window_layers=0).kv_sliding_window == 512
    # layer 0 attends to everything (hybrid): every block is kept
    assert create(**qwen2, use_sliding_window=True, max_window_layers=1).kv_sliding_window is None
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"],
                                                   "sliding_window": 512}))
    kept = EngineConfig.create(model=str(model), disable_hybrid_kv_cache_manager=True)
    assert kept.kv_sliding_window is None
    with pytest.raises(ConfigError, match="sliding_window"):
        create(architectures=["MistralForCausalLM"], sliding_window=-4)


def _with_dtype(llama_dir, tmp_path, dtype: str):
    import shutil

    model = tmp_path / f"model-{dtype}"
    shutil.copytree(llama_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "dtype": dtype}))
    return model


@pytest.mark.parametrize(
    ("model_dtype", "flags", "device", "expected"),
    [
        ("bfloat16", {"avx512_bf16"}, "cpu", "bfloat16"),  # the model's own dtype, natively supported
        ("bfloat16", {"amx_bf16"}, "cpu", "bfloat16"),
        ("bfloat16", {"bf16"}, "cpu", "bfloat16"),  # Arm FEAT_BF16
        ("bfloat16", {"avx512f"}, "cpu", "float32"),  # no native bf16: float32
        ("float16", {"avx512_bf16"}, "cpu", "float32"),
        ("float16", {"avx512_fp16"}, "cpu", "float16"),
        ("float32", {"avx512_bf16"}, "cpu", "bfloat16"),  # bf16 dot products: a float32 model runs in bf16
        ("float32", {"amx_bf16"}, "cpu", "bfloat16"),
        ("float32", {"avx512f", "bf16"}, "cpu", "float32"),  # no bf16 dot products on x86 / Arm: float32
        ("float32", set(), "cuda", "bfloat16"),
        ("float16", set(), "cuda", "float16"),
    ],
)
def test_auto_dtype_is_the_models_own_where_the_device_supports_it(
    llama_dir, tmp_path, monkeypatch, model_dtype, flags, device, expected
) -> None:
    import engine_svc.config as config_module

    monkeypatch.setattr(config_module, "cpu_flags", lambda: frozenset(flags))
    cfg = EngineConfig.create(model=str(_with_dtype(llama_dir, tmp_path, model_dtype)), device=device)
    assert cfg.model_dtype == model_dtype and cfg.torch_dtype_name == expected
    forced = EngineConfig.create(model=str(_with_dtype(llama_dir, tmp_path / "f", model_dtype)), device=device,
                                 dtype="float32")
    assert forced.torch_dtype_name == "float32"  # --dtype wins


def test_cpu_bf16_support_agrees_with_torch() -> None:
    import platform

    import torch

    from engine_svc.config import cpu_supports

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("torch's bf16 probes are x86 ones")
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert cpu_supports("bfloat16") == native
    assert cpu_supports("float32")


def test_max_model_len_is_lowered_to_what_the_kv_cache_holds(llama_dir, caplog) -> None:
    from engine_svc.executor.base import effective_max_model_len

    cfg = EngineConfig.create(model=str(llama_dir), max_model_len=128, block_size=16)
    with caplog.at_level("WARNING", logger="engine_svc.executor.base"):
        assert effective_max_model_len(cfg, num_blocks=8) == 128  # 128 tokens fit: unchanged
        assert not caplog.records
        assert effective_max_model_len(cfg, num_blocks=4) == 64
    assert "holds 64 tokens (4 blocks x 16), fewer than max_model_len=128" in caplog.text
