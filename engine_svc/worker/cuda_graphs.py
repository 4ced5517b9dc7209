"""CUDA graphs for decode steps: capture the model forward once per batch size, replay it every step.

Why: a decode step of a small model is a few hundred short kernels, and launching them one by one from
Python costs more than running them. A captured graph launches them all at once (seed 003, vLLM's
CUDAGraphRunner).

What is captured:
- the model forward only (input ids -> final hidden states); logits and sampling run eagerly on the
  rows of real requests;
- decode-only steps: every scheduled request has q_len == 1. A step with any prefill chunk, or with
  more requests than the largest captured size, runs eagerly (`graph_batch_size`);
- with --enable-lora, the LoRA layers too when they run the Triton kernels (`LoRAManager.graph_safe`:
  slot weights and the token mapping are fixed buffers, written before each replay);
- batch sizes `capture_sizes(max_num_seqs)`, largest first, all graphs sharing one memory pool; a batch
  of n requests replays the smallest captured size B >= n.

Padding: rows n..B-1 of a replay are dummy requests: token 0 at position 0, cache slot -1 (the KV
write kernel skips negative slots, so dummies never touch the KV cache), seq_len 1 and block 0 (attention
reads one key of block 0 and the result is thrown away). Nothing leaks into real rows: apart from
attention, which reads only the cache, every op of the model is row-wise.

Static buffers: a graph reads the device tensors of the runner's `StepStaging` (engine_svc/worker/
staging.py), the same ones eager steps read; their capacity is fixed, so their addresses never change.
`replay` has the staging write the step's inputs, padded in place, into its pinned host arrays and copy
them up asynchronously (no host sync, no per-step allocation).

Host values: a graph cannot see host values that change between replays. The triton backend reads two
host ints: max_query_len (1 for every decode-only step: it selects the decode path) and max_seq_len
(it only tunes how many KV splits the kernel uses), for which the graph bakes in the upper bound
max_blocks_per_req * block_size. The split count is thus chosen for the longest context, but the
kernel gives each split at least a minimum number of key tiles, so a short context runs on its first
few splits and the rest exit at once, writing nothing the reduction reads (kernels/paged_attention.py).
`seq_lens_cpu` / `query_lens_cpu` in the captured metadata are placeholders that the triton backend
never reads; the torch backend plans attention from those host lists, which is why graphs need the
triton backend.

Graph memory is measured as the device memory the captures leave in use, with the allocator's cache
released before and after (`memory_held_by`): `torch.cuda.graph` empties the cache on entry, so a bare
free-memory difference counts blocks cached by earlier work (e.g. the profile run) as freed by the
capture, and came out negative.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

from engine_svc.worker.input_batch import StepInputs
from engine_svc.worker.staging import StepStaging

if TYPE_CHECKING:
    from engine_svc.config import EngineConfig

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


def memory_held_by(
    run: Callable[[], _T], *, free_bytes: Callable[[], int], release_cached: Callable[[], None]
) -> tuple[_T, int]:
    """(run(), device bytes that run() leaves in use).

    Free memory is read with the caching allocator's unused blocks released on both sides, so blocks
    cached before `run` (which `run` may release itself, as `torch.cuda.graph` does) are not counted as
    memory it freed, and blocks it only borrowed are not counted as memory it holds."""
    release_cached()
    before = free_bytes()
    result = run()
    release_cached()
    return result, before - free_bytes()


# ---- pure planning (no device) ----------------------------------------------------------------
def capture_sizes(max_num_seqs: int) -> list[int]:
    """Ascending batch sizes to capture: 1, 2, 4, 8, then multiples of 8 up to 256 and multiples of 16
    beyond, none above max_num_seqs, and max_num_seqs itself, so that every decode batch fits a graph."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    candidates = [1, 2, 4, *range(8, 257, 8), *range(272, max_num_seqs + 1, 16)]
    sizes = [s for s in candidates if s <= max_num_seqs]
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def padded_batch_size(num_reqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest of `sizes` (ascending) that is >= num_reqs, or None when num_reqs exceeds them all."""
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) else None


def graph_batch_size(num_reqs: int, num_decodes: int, sizes: Sequence[int]) -> int | None:
    """The captured size a step replays, or None when the step must run eagerly.

    Eager when the step is empty, when any request has q_len != 1 (num_decodes < num_reqs: a prefill
    chunk is in the batch), or when num_reqs is larger than every captured size.
    """
    if num_reqs == 0 or num_decodes != num_reqs:
        return None
    return padded_batch_size(num_reqs, sizes)


def graphs_off_reason(
    *, device_type: str, attention_backend: str, enforce_eager: bool, tensor_parallel_size: int,
    pipeline_parallel_size: int = 1,
) -> str | None:
    """Why decode CUDA graphs cannot be used with these settings, or None when they can."""
    if device_type != "cuda":
        return "not running on CUDA"
    if enforce_eager:
        return "--enforce-eager was given"
    if attention_backend != "triton":
        return (f"the {attention_backend} attention backend plans attention from host lists, which a "
                "graph cannot capture; use --attention-backend triton")
    if tensor_parallel_size > 1:
        return "tensor parallelism > 1 (collectives inside captured graphs are not supported yet)"
    if pipeline_parallel_size > 1:
        return "pipeline parallelism > 1 (stage hand-offs inside captured graphs are not supported yet)"
    return None


# ---- capture and replay -----------------------------------------------------------------------
class DecodeCudaGraphs:
    """One captured model forward per decode batch size, replayed by the model runner.

    `size_for(inputs)` says whether (and at which size) a step can replay; `replay(inputs, size)` returns
    the hidden states of the step's real requests, a view into the graph's output that stays valid until
    the next replay.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        *,
        sizes: Sequence[int],
        staging: StepStaging,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        self.device = device
        self.staging = staging
        # the longest context a replay may see: the served max_model_len, in whole blocks
        self.max_seq_len = staging.block_table.device.shape[1] // staging.num_groups * block_size
        self.num_replays = 0
        self.memory_bytes = 0  # device memory the captured graphs hold (set by capture)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    def size_for(self, inputs: StepInputs) -> int | None:
        return graph_batch_size(len(inputs.req_ids), inputs.num_decodes, self.sizes)

    def forward_static(self, size: int) -> torch.Tensor:
        """The model over the first `size` rows of the buffers: exactly what a graph captures."""
        tokens = self.staging.tokens.device
        meta = self.staging.graph_metadata(size, self.max_seq_len)
        return self.model(tokens[0, :size], tokens[1, :size], self.kv_caches, meta)  # type: ignore[no-any-return]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, into one shared memory pool (needs the KV cache allocated).

        Each size first runs once eagerly, so Triton compiles that size's kernel variants outside the
        capture. The staging buffers hold dummy requests only, so capturing writes nothing to the KV cache.
        """
        start = time.perf_counter()
        _, used = memory_held_by(
            self._capture_all,
            free_bytes=lambda: int(torch.cuda.mem_get_info(self.device)[0]),
            release_cached=torch.cuda.empty_cache,
        )
        self.memory_bytes = used
        logger.info(
            "CUDA graphs: captured %d decode batch sizes (%d..%d) in %.2f s, graph memory %.1f MiB",
            len(self.sizes), self.sizes[0], self.sizes[-1], time.perf_counter() - start, used / 2**20,
        )

    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self.forward_static(size)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[size] = self.forward_static(size)
            self._graphs[size] = graph
        torch.cuda.synchronize(self.device)

    def replay(self, inputs: StepInputs, size: int,
               fill: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode-only step of n <= size requests (`fill`: see
        `StepStaging.stage_inputs`)."""
        self.staging.stage_inputs(inputs, pad_to=size, fill=fill)
        out = self._run(size)
        self.num_replays += 1
        return out[: len(inputs.req_ids)]

    def _run(self, size: int) -> torch.Tensor:
        self._graphs[size].replay()
        return self._outputs[size]


def maybe_capture_decode_graphs(
    config: EngineConfig,
    model: torch.nn.Module,
    kv_caches: list[torch.Tensor],
    *,
    device: torch.device,
    staging: StepStaging,
) -> DecodeCudaGraphs | None:
    """Capture decode graphs when the settings allow (`graphs_off_reason`), else None.

    Call after the KV cache is allocated. Says why graphs are off when on CUDA; silent on CPU.
    """
    reason = graphs_off_reason(
        device_type=device.type,
        attention_backend=config.resolved_attention_backend,
        enforce_eager=config.enforce_eager,
        tensor_parallel_size=config.tensor_parallel_size,
        pipeline_parallel_size=config.pipeline_parallel_size,
    )
    if reason is not None:
        if device.type == "cuda":
            logger.info("CUDA graphs off: %s", reason)
        return None
    graphs = DecodeCudaGraphs(
        model,
        kv_caches,
        sizes=capture_sizes(config.max_num_seqs),
        staging=staging,
        block_size=config.block_size,
        device=device,
    )
    graphs.capture()
    return graphs
