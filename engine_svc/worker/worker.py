"""One worker per device: loads its shard of the model, owns the KV cache, runs steps.

Lifecycle (driven by an executor): `load_model()` -> `determine_num_blocks()` ->
`initialize_cache(n, max_model_len)` (the executor passes the minimum over all ranks and the max_model_len
the engine serves) -> `execute_model(so)` per step.
"""

from __future__ import annotations

import logging

import torch

from engine_svc.config import EngineConfig
from engine_svc.kv.groups import KVGroups
from engine_svc.kv_transfer.blocks import ShardSlice, apply_loads
from engine_svc.kv_transfer.shards import RankShard
from engine_svc.lora.manager import LoRAManager
from engine_svc.lora.runtime_loads import LoRANews, RuntimeLoads
from engine_svc.model.layers.cpu_gemm import prepack_linears, prepack_wanted
from engine_svc.model.registry import resolve_dtype
from engine_svc.sched.output import ModelRunnerOutput, SchedulerOutput
from engine_svc.spec.ngram import NgramProposer
from engine_svc.worker.cpu_threads import ThreadGovernor, governor_enabled, set_cpu_threads
from engine_svc.worker.cuda_graphs import maybe_capture_decode_graphs
from engine_svc.worker.draft_step import DraftRunner
from engine_svc.worker.eagle3_step import Eagle3Runner, load_eagle3_runner
from engine_svc.worker.model_runner import ModelRunner
from engine_svc.worker.sampled_feed import PendingOutput
from engine_svc.worker.spec_async import AsyncSpeculation

logger = logging.getLogger(__name__)


def make_attention_backend(name: str) -> object:
    if name == "torch":
        from engine_svc.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    from engine_svc.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.device = self._init_device()
        self.dtype = resolve_dtype(config.torch_dtype_name)
        self.model: torch.nn.Module | None = None
        self.runner: ModelRunner | None = None
        self.kv_shard: ShardSlice | None = None  # P/D: this rank's part of a pulled block (kv_transfer/shards.py)
        self.kv_shards: list[RankShard] = []
        self.lora_loads: RuntimeLoads | None = None
        self._reading = False  # a run-time LoRA read is in flight beside the steps (a core lent to it)

    def _init_device(self) -> torch.device:
        if self.config.device == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("--device cuda was asked for but CUDA is not available on this machine; "
                                   "use --device cpu")
            local = self.rank % (self.config.world_size // self.config.nnodes)  # this node's GPU index
            torch.cuda.set_device(local)
            return torch.device("cuda", local)
        world = self.config.world_size // self.config.nnodes  # the ranks sharing this node's cores
        self.cpu_threads = threads = set_cpu_threads(world)
        self._lending = False
        self.governor = ThreadGovernor(threads, world) if governor_enabled() else None
        logger.info("CPU worker rank %d: %d intra-op threads%s", self.rank, threads,
                    " (fewer while other processes hold cores)" if self.governor is not None else "")
        return torch.device("cpu")

    def load_model(self) -> None:
        from engine_svc.model.loader import load_model

        torch.manual_seed(self.config.seed)
        backend = make_attention_backend(self.config.resolved_attention_backend)
        self.model = load_model(self.config.model, dtype=self.dtype, device=self.device, attn_backend=backend,
                                expert_parallel=self.config.enable_expert_parallel)
        if prepack_wanted(self.dtype, self.device):
            prepack_linears(self.model)
        lora = self._load_lora() if self.config.enable_lora else None
        if self.device.type == "cpu" and self.config.resolved_attention_backend == "torch":
            from engine_svc.attention import cpu_paged

            cpu_paged.load()  # build or load the native decode op now, not inside the first decode step
        self.runner = ModelRunner(
            self.model,
            device=self.device,
            max_num_seqs=self.config.max_num_seqs,
            max_model_len=int(self.config.max_model_len or 0),
            block_size=self.config.block_size,
            vocab_size=self.model.vocab_size,
            max_num_batched_tokens=int(self.config.max_num_batched_tokens or self.config.max_model_len or 0),
            async_scheduling=self.config.resolved_async_scheduling,
            kv_num_groups=self.kv_groups.num_groups if self.kv_groups is not None else 1,
        )
        self.runner.lora = lora
        self.lora_loads = RuntimeLoads(lora) if lora is not None else None  # run-time loads, read off the step
        if lora is not None and lora.step.kernels:  # the kernels' token mapping goes up with the step's inputs
            lora.step.use_staging(self.runner.staging)
        spec = self.config.speculative
        if spec is not None and spec.method == "eagle3":
            self.runner.drafter = load_eagle3_runner(self.config.model, spec.model, self.model, self.dtype,
                                                     self.device, backend)
            if prepack_wanted(self.dtype, self.device):
                prepack_linears(self.runner.drafter.model)
        elif spec is not None and spec.model is not None:
            self.runner.drafter = self._load_draft(spec.model, backend)
        if spec is not None and self.runner.feed is not None:  # async scheduling: drafts made here (spec_async.py)
            self.runner.spec_async = AsyncSpeculation(
                NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max) if spec.method == "ngram" else None)

    def _load_draft(self, model_dir: str, backend: object) -> DraftRunner:
        """The draft model of --speculative-config (draft_model), loaded like the target, same dtype."""
        from engine_svc.model.loader import load_model

        draft = load_model(model_dir, dtype=self.dtype, device=self.device, attn_backend=backend)
        max_position = getattr(draft, "max_position", None)
        max_model_len = int(self.config.max_model_len or 0)
        if max_position is not None and max_model_len > max_position:
            from engine_svc.config import ConfigError

            raise ConfigError(f"--speculative-config model {model_dir!r} has {max_position} rotary positions "
                              f"(max_position_embeddings), fewer than max_model_len {max_model_len}; lower "
                              "--max-model-len")
        if prepack_wanted(self.dtype, self.device):
            prepack_linears(draft)
        return DraftRunner(draft, self.device)

    def _load_lora(self) -> LoRAManager:
        """Adapter slots on the model, and every --lora-modules adapter read, validated and kept on the host."""
        from engine_svc.lora.manager import load_adapters

        cfg = self.config
        tokens = max(int(cfg.max_num_batched_tokens or cfg.max_model_len or 0), cfg.max_num_seqs)  # the runner's
        manager = LoRAManager(self.model, max_loras=cfg.max_loras, max_lora_rank=cfg.max_lora_rank,  # type: ignore[arg-type]
                              device=self.device, dtype=self.dtype, max_num_tokens=tokens)
        load_adapters(manager, cfg.lora_modules)
        return manager

    @property
    def kv_groups(self) -> KVGroups | None:
        """The hybrid KV groups this engine runs (engine_svc/kv/groups.py), None when every layer shares
        one table."""
        if self.config.kv_group_windows is None or self.model is None:
            return None
        groups: KVGroups | None = self.model.kv_groups
        if groups is None or groups.windows != self.config.kv_group_windows:
            raise RuntimeError(f"the model's KV groups {groups} differ from the engine's "
                               f"{self.config.kv_group_windows}")
        return groups

    def _stage_slots(self, groups: KVGroups) -> tuple[int, ...]:
        """The cache slots of this rank's layers, in layer order (a pipeline stage holds some layers)."""
        assert self.model is not None
        return groups.layer_slot[self.model.model.start_layer : self.model.model.end_layer]

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one KV block across this rank's layers (K and V; a pipeline stage holds only its own),
        a draft model's layers included. With hybrid KV groups a block holds one group's layers: one
        cache tensor per slot this rank's layers use (engine_svc/kv/groups.py)."""
        m = self.model
        assert m is not None
        per_layer = 2 * m.num_kv_heads * m.head_dim * self.dtype.itemsize
        groups = self.kv_groups
        per_token = per_layer * (m.num_layers if groups is None else len(set(self._stage_slots(groups))))
        if self.runner is not None and self.runner.drafter is not None:
            d = self.runner.drafter.model  # the draft's cache: every pool block, whatever its group
            per_token += 2 * d.num_layers * d.num_kv_heads * d.head_dim * self.dtype.itemsize
        return per_token * self.config.block_size

    def determine_num_blocks(self) -> int:
        cfg = self.config
        if cfg.num_gpu_blocks_override is not None:
            return cfg.num_gpu_blocks_override
        if cfg.kv_cache_memory_bytes is not None:
            budget = cfg.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = self._profile_free_memory()
        else:
            from engine_svc.config import DEFAULT_CPU_KV_CACHE_BYTES

            budget = DEFAULT_CPU_KV_CACHE_BYTES
        num_blocks = budget // self.kv_block_bytes
        if num_blocks < 1:
            from engine_svc.config import ConfigError

            raise ConfigError(
                f"no memory left for the KV cache ({max(budget, 0)} bytes; one block needs {self.kv_block_bytes}): "
                "raise --gpu-memory-utilization or --kv-cache-memory-bytes, or lower --max-num-batched-tokens")
        return int(num_blocks)

    def _profile_free_memory(self) -> int:
        """GPU: total * utilisation - peak memory of the largest step (seed 003).

        The peak counts weights and activations; the profile run's throwaway KV cache is taken off it,
        since the real cache is what this budget sizes. The profile's cached blocks are released
        afterwards, so the cache can use that memory. The CUDA graphs, captured after the cache is
        allocated, are not in this budget: they come out of the (1 - gpu_memory_utilization) headroom
        (their size is logged as "graph memory")."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        assert self.runner is not None
        dummy_cache_bytes = self.runner.profile_run(self.config.max_num_batched_tokens or 8192)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - dummy_cache_bytes
        torch.cuda.empty_cache()
        total = torch.cuda.mem_get_info()[1]
        logger.info("profile run: peak %.1f MiB of weights and activations (%.1f MiB throwaway cache not counted)",
                    peak / 2**20, dummy_cache_bytes / 2**20)
        return int(total * self.config.gpu_memory_utilization - peak)

    def initialize_cache(self, num_blocks: int, max_model_len: int) -> None:
        """Allocate the KV cache, then size the persistent batch and capture CUDA graphs for the served
        `max_model_len` (the executor's value, the same on every rank; at most the configured one)."""
        m, runner = self.model, self.runner
        assert m is not None and runner is not None
        runner.set_max_model_len(max_model_len)
        shape = m.attn_backend.kv_cache_shape(num_blocks, self.config.block_size, m.num_kv_heads, m.head_dim)
        groups = self.kv_groups
        if groups is None:
            runner.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                                for _ in range(m.num_layers)]
        else:  # the j-th layer of every group shares one tensor (engine_svc/kv/groups.py)
            slots = self._stage_slots(groups)
            shared = {j: torch.zeros(shape, dtype=self.dtype, device=self.device) for j in sorted(set(slots))}
            runner.kv_caches = [shared[j] for j in slots]
        if runner.drafter is not None:  # one more cache per draft layer, the same block ids
            d = runner.drafter.model
            shape = d.attn_backend.kv_cache_shape(num_blocks, self.config.block_size, d.num_kv_heads, d.head_dim)
            runner.drafter.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                                        for _ in range(d.num_layers)]
        # -- CUDA graphs hook: capture decode graphs now that the cache exists (None when off) --
        # EAGLE-3 steps run eagerly (every step keeps the target's auxiliary hidden states, which a graph
        # replay would not hand over); so do LoRA steps on the torch path (it decides on host values)
        if (runner.lora is None or runner.lora.graph_safe) and not isinstance(runner.drafter, Eagle3Runner):
            runner.cuda_graphs = maybe_capture_decode_graphs(
                self.config, m, runner.kv_caches, device=self.device, staging=runner.staging,
            )

    def lend_core(self, lend: bool) -> None:
        """CPU: one intra-op thread fewer while `lend` holds. A grammar compile on its own thread beside a
        full OpenMP team oversubscribes the cores, and the team then waits at every barrier for a
        descheduled thread (tests/realmodel/test_structured_outputs_served.py has a streaming victim of
        such a compile); with the core lent it keeps flowing."""
        self._lending = lend
        self._apply_threads()

    def _apply_threads(self) -> None:
        """The team size the governor (or the static count) and a lent core ask for, set if it differs."""
        if self.device.type != "cpu":
            return
        lend = self._lending or self._reading
        if self.governor is not None:
            want = self.governor.threads(lend)
        else:
            want = max(1, self.cpu_threads - 1) if lend else self.cpu_threads
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | PendingOutput:
        """The step's output, or under async scheduling a `PendingOutput` whose `get()` waits for it."""
        assert self.runner is not None
        if self.governor is not None and self.governor.observe():
            self._apply_threads()
        if so.kv_loads:  # P/D disaggregation: pulled K/V of the requests this step admits, before they run
            apply_loads(self.runner.kv_caches, so.kv_loads, self.kv_shard)
        self.runner.pulled_blocks = {b for load in so.kv_loads for b in load.block_ids} if so.kv_loads else set()
        loads = self.lora_loads
        if loads is None or not (so.lora_loads or so.lora_drops or loads.pending):
            return self.runner.execute_model(so)
        news = loads.step(so.lora_loads, so.lora_drops, idle=so.total_num_scheduled_tokens == 0)
        if self.device.type == "cpu" and self._reading != loads.reading:
            self._reading = loads.reading  # the reader's thread gets a core while it reads
            self._apply_threads()
        return _with_news(self.runner.execute_model(so), news)

    def shutdown(self) -> None:
        """Stop the background LoRA reader (the executors call it when the engine stops)."""
        if self.lora_loads is not None:
            self.lora_loads.close()


def _with_news(out: ModelRunnerOutput | PendingOutput, news: LoRANews) -> ModelRunnerOutput | PendingOutput:
    """`out` carrying the step's LoRA readiness (ModelRunnerOutput.lora_ready / lora_failed)."""
    if news.ready or news.failed:
        out.lora_ready, out.lora_failed = news.ready, news.failed
    return out
