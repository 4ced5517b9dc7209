"""Speculative decoding together with async scheduling, against speculation off and async scheduling off.

The oracles: plain synchronous decoding (itself equal to transformers: test_hf_exact.py) for greedy
requests, and for seeded sampled ones too (a seeded request's tokens are plain decoding's whatever the
drafts: engine_svc/spec/rejection.py); synchronous speculation for the acceptance counters (prompt
lookup proposes from the same tokens on the worker as on the scheduler). The `looping` model (its
greedy output cycles, so prompt lookup predicts it) accepts most drafts; the random llama rejects most.
Layer 1's attention moves every logprob, so K/V written at a wrong position (a position not corrected
for the previous step's rejected drafts) shows in the tokens or the logprobs.

Every test also checks that the overlap is kept: steps of speculating requests are scheduled while the
previous step is in flight (a `StepSpy` on the scheduler counts them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine_svc.core import EngineCore
from engine_svc.sched.scheduler import Scheduler
from entrypoints import LLM, SamplingParams
from entrypoints.layer_draft import make_layer_draft
from tests.engine.test_async_scheduling import core_requests, make_core, step_all, summary
from tests.engine.test_hf_exact import assert_no_block_leaks
from tests.engine.test_spec_decode import (
    NGRAM,
    assert_same_logprobs,
    completions,
    looping_dir,  # noqa: F401 (a fixture)
    repetitive_prompts,
)
from tests.engine.test_spec_eagle3 import eagle_spec, heads  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(300)
SMALL_STEPS = dict(block_size=4, max_num_batched_tokens=32)  # drafts cross blocks; prompts in chunks


class OverlapSpy:
    """Counts the schedules that gave draft places to a request with a verification in flight."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.overlapped = 0
        schedule = scheduler.schedule

        def spy() -> Any:
            in_flight = {r.request_id for r in scheduler.running if r.num_spec_in_flight}
            so = schedule()
            self.overlapped += len(in_flight & set(so.scheduled_spec_decode_tokens))
            return so

        scheduler.schedule = spy  # type: ignore[method-assign]


def run(model_dir: Path, prompts: list[list[int]], params: Any, spec: dict[str, Any] | None, async_: bool,
        **engine_args: Any) -> tuple[list, LLM, OverlapSpy]:
    llm = LLM(str(model_dir), dtype="float32", device="cpu", speculative_config=spec, async_scheduling=async_,
              **engine_args)
    spy = OverlapSpy(llm.engine.scheduler)
    return llm.generate(prompts, params, use_tqdm=False), llm, spy


@pytest.fixture(scope="module")
def draft_dir(looping_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    return make_layer_draft(looping_dir, tmp_path_factory.mktemp("draft") / "near", 2, scale_attention=0.5)


def spec_of(method: str, draft_dir: Path, heads: dict[str, Path], k: int) -> dict[str, Any]:  # noqa: F811
    if method == "ngram":
        return {**NGRAM, "num_speculative_tokens": k}
    if method == "draft_model":
        return {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": k}
    return eagle_spec(heads["random"], k)


GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
@pytest.mark.parametrize("model", ["random", "looping"])
def test_greedy_async_speculation_equals_plain_sync_decoding(method: str, model: str, llama_dir: Path,
                                                             looping_dir: Path, draft_dir: Path,  # noqa: F811
                                                             heads: dict[str, Path]) -> None:  # noqa: F811
    """Chunked prefill, prefix caching (the prompts share prefixes), blocks that drafts cross."""
    model_dir = llama_dir if model == "random" else looping_dir
    prompts = repetitive_prompts(5, 5)
    prompts += [prompts[0] + [7, 8, 9]]  # a prefix-cache hit on the first prompt's blocks
    plain, _, _ = run(model_dir, prompts, GREEDY, None, False, **SMALL_STEPS)
    spec = spec_of(method, draft_dir, heads, 3)
    got, llm, spy = run(model_dir, prompts, GREEDY, spec, True, **SMALL_STEPS)
    assert completions(got) == completions(plain)
    assert_same_logprobs(plain, got)
    stats = llm.engine.get_stats()
    assert stats.spec_decode_num_drafts > 0 and spy.overlapped > 0
    if model == "looping" and method != "eagle3":
        assert stats.spec_decode_num_accepted_tokens > 0.5 * stats.spec_decode_num_draft_tokens
    assert_no_block_leaks(llm)
