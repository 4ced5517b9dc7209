"""The CPU step defaults as the scheduler applies them (engine_svc/config.py, CPU_MAX_NUM_BATCHED_TOKENS and
CPU_LONG_PREFILL_TOKEN_THRESHOLD; BENCHMARKS.md, "Served on CPU: the step policy against vLLM"):
- a prompt of up to 256 tokens that arrives while 15 streams decode is prefilled in the step that
  carries their tokens (served TTFT: one step, not four 64-token chunks);
- a long prompt beside decodes still goes in chunks of the threshold, the decodes in every step;
- a burst of prompts fills the step's budget, several prompts a step.
"""

from __future__ import annotations

import random
from pathlib import Path

from engine_svc.config import EngineConfig
from engine_svc.request import Request
from engine_svc.sched.output import ModelRunnerOutput
from engine_svc.sched.scheduler import Scheduler
from shared_runtime.contract import EngineCoreRequest, EngineSamplingParams

BLOCK = 16
DECODERS = 15


def _cpu_scheduler(llama_dir: Path) -> Scheduler:
    cfg = EngineConfig.create(model=str(llama_dir), device="cpu")
    assert cfg.max_num_batched_tokens is not None and cfg.long_prefill_token_threshold is not None
    return Scheduler(max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                     max_model_len=4096, block_size=BLOCK, num_blocks=1024,
                     long_prefill_token_threshold=cfg.long_prefill_token_threshold)


def _add(sched: Scheduler, rid: str, prompt_len: int, max_tokens: int) -> None:
    rng = random.Random(rid)  # prompts of their own: no prefix-cache hits between requests
    core = EngineCoreRequest(request_id=rid, prompt_token_ids=[rng.randrange(3, 400) for _ in range(prompt_len)],
                             sampling_params=EngineSamplingParams(max_tokens=max_tokens, ignore_eos=True),
                             arrival_time=float(len(sched.requests)))
    sched.add_request(Request(core, sched.max_model_len))


def _step(sched: Scheduler) -> dict[str, int]:
    """One step with a fake model that samples token 7 wherever a request reaches its last token."""
    so = sched.schedule()
    sampled = [7 if sched.requests[r].num_computed_tokens == sched.requests[r].num_tokens else -1
               for r in so.num_scheduled_tokens]
    sched.update_from_output(so, ModelRunnerOutput(req_ids=list(so.num_scheduled_tokens), sampled_token_ids=sampled))
    return dict(so.num_scheduled_tokens)


def _decoding(sched: Scheduler) -> list[str]:
    """Start DECODERS streams (16-token prompts) and step until all of them decode."""
    ids = [f"d{i}" for i in range(DECODERS)]
    for rid in ids:
        _add(sched, rid, 16, max_tokens=1000)
    while any(sched.requests[r].num_computed_tokens < sched.requests[r].num_prompt_tokens for r in ids):
        _step(sched)
    return ids


def _drain(sched: Scheduler) -> None:
    sched.finish_requests(list(sched.requests))
    _step(sched)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks, "KV blocks leaked"


def test_a_256_token_prompt_is_prefilled_in_one_step_beside_15_decodes(llama_dir: Path) -> None:
    sched = _cpu_scheduler(llama_dir)
    decoders = _decoding(sched)
    _add(sched, "new", 256, max_tokens=4)
    counts = _step(sched)
    assert counts == {**{rid: 1 for rid in decoders}, "new": 256}  # one step, the streams' tokens in it
    _drain(sched)


def test_a_long_prompt_beside_decodes_goes_in_threshold_chunks(llama_dir: Path) -> None:
    sched = _cpu_scheduler(llama_dir)
    threshold = sched.long_prefill_token_threshold
    decoders = _decoding(sched)
    _add(sched, "long", 2000, max_tokens=1)
    chunks = []
    while "long" in sched.requests:
        counts = _step(sched)
        assert all(counts.get(rid) == 1 for rid in decoders), "a decode was left out of a prefill step"
        chunks.append(counts.get("long", 0))
    assert 0 < threshold < 2000 and max(chunks) == threshold and sum(chunks) == 2000
    _drain(sched)


def test_a_burst_of_prompts_fills_the_budget_beside_decodes(llama_dir: Path) -> None:
    sched = _cpu_scheduler(llama_dir)
    decoders = _decoding(sched)
    for i in range(16):
        _add(sched, f"p{i}", 256, max_tokens=4)
    counts = _step(sched)
    prefill = {rid: n for rid, n in counts.items() if rid not in decoders}
    assert sum(counts.values()) == sched.max_num_batched_tokens
    chunk = min(256, sched.long_prefill_token_threshold)
    assert len(prefill) == -(-(sched.max_num_batched_tokens - DECODERS) // chunk)  # full chunks, the last cut
    _drain(sched)
