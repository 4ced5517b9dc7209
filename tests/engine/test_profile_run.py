"""The memory-profiling run (ModelRunner.profile_run) and the CUDA-graph memory figure, on CPU.

Regression: the profile run used to prefill max_num_batched_tokens positions as ONE sequence, so a model
with max_position_embeddings < max_num_batched_tokens (2048 < 8192 for the tiny models, TinyLlama,
Llama-2 at 4096) gathered past the end of its rotary cache: a device-side assert on GPU, and the engine
died at start. On CPU the same gather raises, so these tests catch it without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from engine_svc.config import EngineConfig
from engine_svc.worker.cuda_graphs import memory_held_by
from engine_svc.worker.model_runner import ModelRunner, profile_seq_lens
from engine_svc.worker.worker import Worker


@pytest.mark.parametrize(
    ("num_tokens", "max_model_len", "max_num_seqs", "expected"),
    [
        (8192, 256, 256, [256] * 32),  # the budget in full-length sequences
        (8192, 3000, 256, [3000, 3000, 2192]),  # a shorter last sequence
        (8192, 256, 4, [256] * 4),  # capped: 4 sequences of 256 are the most a step can hold
        (100, 4096, 256, [100]),  # a budget below max_model_len: one sequence
        (5, 2, 2, [2, 2]),
    ],
)
def test_profile_seq_lens(num_tokens, max_model_len, max_num_seqs, expected):
    lens = profile_seq_lens(num_tokens, max_model_len, max_num_seqs)
    assert lens == expected
    assert max(lens) <= max_model_len and len(lens) <= max_num_seqs


def _worker(make_model, backend: str, max_pos: int, device: str = "cpu", **kw) -> Worker:
    model_dir = make_model("qwen3", max_position_embeddings=max_pos)
    config = EngineConfig.create(model=str(model_dir), dtype="float32", device=device, attention_backend=backend, **kw)
    worker = Worker(config)
    worker.load_model()
    return worker


def _record_forward(worker: Worker) -> list[tuple[torch.Tensor, object]]:
    calls: list[tuple[torch.Tensor, object]] = []
    model = worker.model
    inner = model.forward

    def forward(input_ids, positions, kv_caches, meta):
        calls.append((positions.clone(), meta))
        return inner(input_ids, positions, kv_caches, meta)

    model.forward = forward
    return calls


def test_profile_run_never_passes_max_model_len(make_model):
    """max_position_embeddings 256, a budget of 8192 tokens, torch backend: the reproduction."""
    worker = _worker(make_model, "torch", 256, max_num_batched_tokens=8192)
    assert worker.config.max_model_len == 256
    calls = _record_forward(worker)
    cache_bytes = worker.runner.profile_run(8192)
    (positions, meta), = calls
    assert positions.numel() == 8192
    assert int(positions.max()) == 255
    assert meta.seq_lens_cpu == [256] * 32 and meta.query_lens_cpu == [256] * 32
    assert meta.query_start_loc.tolist() == list(range(0, 8193, 256))
    m = worker.model
    per_layer = 2 * (256 // worker.config.block_size) * worker.config.block_size * m.num_kv_heads * m.head_dim * 4
    assert cache_bytes == m.num_layers * per_layer  # one sequence's worth, shared by all


def test_profile_run_respects_max_num_seqs(make_model):
    worker = _worker(make_model, "torch", 256, max_num_batched_tokens=8192, max_num_seqs=3)
    calls = _record_forward(worker)
    worker.runner.profile_run(8192)
    (positions, meta), = calls
    assert meta.seq_lens_cpu == [256, 256, 256] and positions.numel() == 768


def test_profile_run_on_the_triton_backend(make_model):
    """The fused RoPE + cache-write kernel and the attention kernel on the profile shapes: compiled on a
    GPU machine, through the interpreter on CPU (a GPU machine does not switch the interpreter on)."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    worker = _worker(make_model, "triton", 32, device, max_num_batched_tokens=80, max_num_seqs=4, block_size=8)
    calls = _record_forward(worker)
    worker.runner.profile_run(80)
    (positions, meta), = calls
    assert meta.seq_lens_cpu == [32, 32, 16] and int(positions.max()) == 31


def test_runner_refuses_max_model_len_past_the_rotary_cache(make_model):
    worker = _worker(make_model, "torch", 64)
    with pytest.raises(ValueError, match="max_model_len 65 exceeds the model's 64 rotary positions"):
        ModelRunner(worker.model, device=torch.device("cpu"), max_num_seqs=4, max_model_len=65, block_size=16,
                    vocab_size=worker.model.vocab_size, max_num_batched_tokens=64)


def test_out_of_range_position_is_a_clear_error_not_a_gather_fault(make_model):
    worker = _worker(make_model, "torch", 64)
    rope = worker.model.model.rotary_emb
    with pytest.raises(ValueError, match="position 64 is outside the rotary cache"):
        rope.cos_sin(torch.arange(60, 65))


# ---- the CUDA-graph memory figure --------------------------------------------------------------
class FakeAllocator:
    """A caching allocator over a device of `total` bytes: `cached` bytes are reserved but unused."""

    def __init__(self, total: int, in_use: int, cached: int) -> None:
        self.total, self.in_use, self.cached = total, in_use, cached

    def free_bytes(self) -> int:
        return self.total - self.in_use - self.cached

    def release_cached(self) -> None:
        self.cached = 0

    def capture(self, graph_bytes: int, scratch_bytes: int) -> None:
        """What capturing does: torch.cuda.graph releases the cache on entry, the warm-up borrows
        scratch memory that ends up cached, and the graph pool keeps its memory."""
        self.release_cached()
        self.cached += scratch_bytes
        self.in_use += graph_bytes


def test_graph_memory_counts_only_what_the_graphs_hold():
    alloc = FakeAllocator(total=80 << 30, in_use=60 << 30, cached=3 << 30)  # 3 GiB cached by the profile run
    free_before = alloc.free_bytes()
    _, held = memory_held_by(lambda: alloc.capture(graph_bytes=200 << 20, scratch_bytes=50 << 20),
                             free_bytes=alloc.free_bytes, release_cached=alloc.release_cached)
    assert held == 200 << 20
    # The figure the engine used to log: free before - free after, around a capture that empties the cache.
    naive = FakeAllocator(total=80 << 30, in_use=60 << 30, cached=3 << 30)
    naive_before = naive.free_bytes()
    naive.capture(graph_bytes=200 << 20, scratch_bytes=50 << 20)
    assert naive_before - naive.free_bytes() < 0  # negative, as the "-1256.0 MiB" log line was
    assert free_before == naive_before


def test_memory_held_by_returns_the_result():
    alloc = FakeAllocator(total=100, in_use=10, cached=0)
    result, held = memory_held_by(lambda: "done", free_bytes=alloc.free_bytes, release_cached=alloc.release_cached)
    assert (result, held) == ("done", 0)
