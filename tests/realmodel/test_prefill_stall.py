"""One long prompt must not stall the other streams on CPU (issue 22): SmolLM2-135M in float32, the CPU
defaults (256-token steps, prompts prefilled 64 tokens a step while others decode). Before: 8,192-token
steps prefilled a 2,000-token prompt in one go and a decoding victim got no token for ~4 s.

In process (the engine core stepped in a loop, as its busy loop does): the victim's gap is the time
between the steps that gave it a token, which is what its stream sees, less the transport."""

from __future__ import annotations

import itertools
import random
import statistics
import time
from pathlib import Path

import pytest

from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from shared_runtime.contract import EngineCoreRequest, EngineSamplingParams

pytestmark = pytest.mark.slow
PROMPT_TOKENS = 2000
MAX_VICTIM_GAP_S = 0.5


def test_a_2000_token_prompt_does_not_stall_a_streaming_victim(smollm2_dir: Path) -> None:
    config = EngineConfig.create(model=str(smollm2_dir), dtype="float32", device="cpu", max_model_len=4096)
    assert (config.max_num_batched_tokens, config.long_prefill_token_threshold) == (256, 64)  # the CPU defaults
    core = EngineCore(config)
    greedy = EngineSamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
    core.add_request(EngineCoreRequest(request_id="victim", prompt_token_ids=[1, 504, 3458, 282], sampling_params=greedy))
    rng = random.Random(0)
    long_prompt = [rng.randrange(100, 40000) for _ in range(PROMPT_TOKENS)]
    victim_tokens: list[float] = []
    first_token_of_long = None
    start = float("inf")
    while first_token_of_long is None:
        outputs = core.step()
        now = time.monotonic()
        for out in outputs.outputs:
            if out.request_id == "victim" and out.new_token_ids:
                victim_tokens.append(now)
            elif out.request_id == "long" and out.new_token_ids:
                first_token_of_long = out.new_token_ids[0]
        if len(victim_tokens) == 3 and start == float("inf"):
            core.add_request(EngineCoreRequest(request_id="long", prompt_token_ids=long_prompt,
                                               sampling_params=EngineSamplingParams(temperature=0.0, max_tokens=1)))
            start = now
    gaps = [b - a for a, b in itertools.pairwise(victim_tokens) if a >= start]
    print(f"[stall] {len(gaps)} victim tokens during the prefill, max gap {max(gaps) * 1000:.0f} ms, "
          f"prefill {victim_tokens[-1] - start:.1f} s")
    assert len(gaps) >= PROMPT_TOKENS // 64 - 1  # a token every step the prompt was prefilled
    # Wall-clock: the typical wait. The longest gap is printed, not asserted: on a shared 2-core box one
    # step now and then loses its cores to other processes for seconds (seen: 4.5 s among 0.13 s steps),
    # which says nothing about the scheduler; the count above is what fails when prefill is not chunked
    # (one 2,000-token step: a single gap), and bench/edge.py records the longest gap on a quiet machine.
    assert statistics.median(gaps) < MAX_VICTIM_GAP_S, f"the victim's median wait {statistics.median(gaps):.2f} s"
    core.abort_requests(["victim"])
    while core.has_unfinished_requests():
        core.step()
    core.shutdown()
