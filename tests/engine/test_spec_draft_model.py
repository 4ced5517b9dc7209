"""Speculative decoding with a draft model, end to end, against the same engine without speculation.

Plain decoding is the oracle (it equals transformers token for token: test_hf_exact.py). Three drafts of
the `looping` target (test_spec_decode.py), all sharing its vocabulary:
- `self`: the target itself. Greedy drafts must then all be accepted, which holds only if the draft's
  own KV cache holds the right K/V at every position it attends to: through chunked prefill, prefix-cache
  hits, preemption and rejected positions. Acceptance is the draft cache's oracle;
- `near`: the target with its attention output halved (layer 1 at 0.05): mostly accepted, some rejected;
- `far`: the first layer of a different random llama: nearly everything rejected (the rollback path).
Sampled requests: the joint distribution of three tokens against transformers' exact probabilities, with
the `near` draft, whose top-k sets differ from the target's (its q is not p).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_svc.config import ConfigError, EngineConfig
from engine_svc.core import EngineCore
from engine_svc.sample.metadata import build_sampling_metadata
from engine_svc.spec.rejection import verify
from entrypoints import LLM, SamplingParams
from entrypoints.layer_draft import make_layer_draft
from shared_runtime.contract import EngineSamplingParams
from tests.engine.test_async_scheduling import core_requests, step_all, summary
from tests.engine.test_hf_exact import assert_no_block_leaks
from tests.engine.test_spec_decode import (
    assert_first_tokens_follow_the_target,
    assert_same_logprobs,
    completions,
    generate,
    looping_dir,  # noqa: F401 (a fixture)
    repetitive_prompts,
    served_tokens,
    stops_inside_runs,
)
from tests.engine.test_spec_rejection import V, chi2, chi2_critical, states, target_probs

pytestmark = pytest.mark.timeout(300)
SMALL_STEPS = dict(block_size=4, max_num_batched_tokens=32)  # drafts cross blocks; prompts in chunks


def draft_spec(model: Path, k: int = 3, **extra: Any) -> dict[str, Any]:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k, **extra}


@pytest.fixture(scope="module")
def drafts(looping_dir: Path, llama_dir: Path, make_model, tmp_path_factory: pytest.TempPathFactory  # noqa: F811
           ) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("drafts")
    return {"self": looping_dir,
            "near": make_layer_draft(looping_dir, root / "near", 2, scale_attention=0.5),
            "far": make_layer_draft(make_model("llama", seed=3), root / "far", 1)}


def acceptance(llm: LLM) -> tuple[int, int]:
    stats = llm.engine.get_stats()
    return stats.spec_decode_num_accepted_tokens, stats.spec_decode_num_draft_tokens


def assert_all_accepted(llm: LLM) -> None:
    """The target as its own draft: every greedy draft accepted. Exactly on CPU; on CUDA the draft's
    single-token passes and the verification's longer queries may round differently (Triton's float32
    dots), which can flip a near-tie, so there 97% suffices."""
    accepted, proposed = acceptance(llm)
    exact = llm.engine.config.device != "cuda"
    assert proposed > 0 and (accepted == proposed if exact else accepted >= 0.97 * proposed), (accepted, proposed)


GREEDY_PROMPTS = repetitive_prompts(3, 5)
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def greedy_plain(looping_dir: Path) -> list:  # noqa: F811
    return generate(looping_dir, GREEDY_PROMPTS, GREEDY, None, **SMALL_STEPS)[0]


@pytest.mark.parametrize("top_k", [0, 3])
def test_verification_with_the_drafts_distribution_preserves_the_targets(top_k: int) -> None:
    """Drafts drawn from q (a distribution unlike p, with tokens p excludes under top-k) are accepted
    with probability min(1, p/q) and recovered from norm(max(0, p - q)): output 0 follows p0, output 1
    (after an accepted draft 0) p1, the bonus token p2. 30000 requests verified in one call."""
    torch.manual_seed(2)
    n = 30000
    base = torch.tensor([[1.0, 0.2, -0.5, 0.9, 0.0, 0.4, -1.0, 0.3],
                         [0.1, 0.5, 0.7, -0.2, 0.0, 1.1, 0.2, -0.4],
                         [0.6, -0.3, 0.2, 0.8, -0.1, 0.0, 0.9, 0.1]])
    q = torch.softmax(torch.tensor([[0.0, 1.5, 0.3, -0.4, 1.0, 0.2, 0.8, -1.0],
                                    [1.2, -0.5, 0.0, 0.9, 0.4, -0.3, 0.1, 0.6]]), dim=-1)
    drafts = torch.stack([torch.multinomial(q[0], n, replacement=True),
                          torch.multinomial(q[1], n, replacement=True)], dim=1).tolist()
    draft_probs = torch.cat([q, torch.zeros(1, V)]).repeat(n, 1)
    meta = build_sampling_metadata(states(EngineSamplingParams(temperature=0.8, top_k=top_k), 3 * n),
                                   torch.device("cpu"))
    runs = verify(base.repeat(n, 1), meta, drafts, draft_probs)
    p = target_probs(base, 0.8, top_k)
    assert all(r[: len(r) - 1] == d[: len(r) - 1] for r, d in zip(runs, drafts))
    for pos in range(3):
        sample = [r[pos] for r in runs if len(r) > pos]
        stat, df = chi2([sample.count(t) for t in range(V)], p[pos].tolist())
        assert stat < chi2_critical(df), (pos, stat, df)
    accept = float(torch.minimum(p[0], q[0]).sum())  # P(draft 0 accepted) = sum_x min(p(x), q(x))
    assert abs(sum(len(r) > 1 for r in runs) / n - accept) < 5 * (accept * (1 - accept) / n) ** 0.5


@pytest.mark.parametrize("name", ["self", "near", "far"])
def test_greedy_draft_model_equals_plain_decoding(name: str, looping_dir: Path, drafts: dict[str, Path],  # noqa: F811
                                                  greedy_plain: list) -> None:
    """Chunked prefill (32-token steps), drafts crossing 4-token blocks, logprobs of every token."""
    plain = greedy_plain
    spec, llm = generate(looping_dir, GREEDY_PROMPTS, GREEDY, draft_spec(drafts[name]), **SMALL_STEPS)
    assert completions(spec) == completions(plain)
    assert_same_logprobs(plain, spec)
    accepted, proposed = acceptance(llm)
    assert proposed > 60
    if name == "self":
        assert_all_accepted(llm)
    elif name == "near":
        assert 0.3 * proposed < accepted < proposed
    else:
        assert accepted < 0.3 * proposed
    assert_no_block_leaks(llm)


def test_prefix_cache_hits_hold_the_drafts_kv(looping_dir: Path, drafts: dict[str, Path]) -> None:  # noqa: F811
    """The same prompts again hit the prefix cache (blocks written by target and draft together): the
    self-draft still has every draft accepted, and the tokens are plain decoding's."""
    prompts = repetitive_prompts(4, 4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain, _ = generate(looping_dir, prompts, params, None, block_size=4)
    budget = 1 << 20
    llm = LLM(str(looping_dir), dtype="float32", speculative_config=draft_spec(drafts["self"]), block_size=4,
              kv_cache_memory_bytes=budget)
    target = llm.engine.executor.worker.model  # the draft's cache (here the same shape) shares each block id
    block_bytes = 2 * target.num_layers * target.num_kv_heads * target.head_dim * 4 * 4
    assert llm.engine.num_blocks == budget // (2 * block_bytes)
    first = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts, params, use_tqdm=False)
    assert completions(first) == completions(again) == completions(plain)
    assert all(out.num_cached_tokens >= 4 for out in again)
    assert_all_accepted(llm)
    assert_no_block_leaks(llm)


def test_preemption_keeps_the_drafts_cache_in_step(looping_dir: Path, drafts: dict[str, Path]) -> None:  # noqa: F811
    """12 blocks of 4 tokens for 6 requests: requests verifying drafts are preempted and recomputed."""
    prompts = repetitive_prompts(5, 6)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=0)
    args = dict(num_gpu_blocks_override=12, block_size=4, max_num_batched_tokens=64)
    plain, _ = generate(looping_dir, prompts, params, None, **args)
    spec, llm = generate(looping_dir, prompts, params, draft_spec(drafts["self"], k=4), **args)
    assert completions(spec) == completions(plain)
    assert_same_logprobs(plain, spec)
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.spec_decode_num_drafts > 0
    assert_all_accepted(llm)
    assert_no_block_leaks(llm)


def test_stops_and_max_tokens_inside_an_accepted_run(looping_dir: Path, drafts: dict[str, Path]) -> None:  # noqa: F811
    prompts, params, cycle_token, stop_string = stops_inside_runs(looping_dir)
    plain, _ = generate(looping_dir, prompts, params, None)
    spec, llm = generate(looping_dir, prompts, params, draft_spec(drafts["self"], k=4))
    assert completions(spec) == completions(plain)
    assert plain[0].outputs[0].stop_reason == cycle_token and plain[1].outputs[0].stop_reason == stop_string
    assert len(plain[2].outputs[0].token_ids) == 23 and acceptance(llm)[0] > 0
    assert_no_block_leaks(llm)


def test_aborts_mid_run_free_every_block(looping_dir: Path, drafts: dict[str, Path]) -> None:  # noqa: F811
    """Requests aborted after some verified runs end once, and every block (the draft's are the same
    ids) comes back; the survivors keep plain decoding's tokens."""
    prompts = repetitive_prompts(6, 4)
    params = dict(temperature=0.0, max_tokens=20, ignore_eos=True)
    config = dict(model=str(looping_dir), dtype="float32", device="cpu", block_size=4)
    core = EngineCore(EngineConfig.create(**config))
    for request in core_requests(prompts, **params):
        core.add_request(request)
    plain = summary(step_all(core))
    core = EngineCore(EngineConfig.create(**config, speculative_config=draft_spec(drafts["near"])))
    for request in core_requests(prompts, **params):
        core.add_request(request)
    spec = summary(step_all(core, abort_after={"r0": 5, "r2": 9}))
    for rid in ("r1", "r3"):
        assert spec[rid] == plain[rid]
    for rid, cut in (("r0", 5), ("r2", 9)):
        tokens = spec[rid][0]
        assert cut <= len(tokens) < 20 and tokens == plain[rid][0][: len(tokens)]
    stats = core.get_stats()
    assert stats.spec_decode_num_drafts > 0
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0


def test_seeded_requests_are_reproducible_whatever_the_batch(looping_dir: Path, drafts: dict[str, Path]  # noqa: F811
                                                             ) -> None:
    prompt = repetitive_prompts(9, 1)[0]
    seeded = SamplingParams(temperature=0.8, seed=1234, max_tokens=16, ignore_eos=True)
    alone, _ = generate(looping_dir, [prompt], seeded, draft_spec(drafts["near"]))
    others = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)] * 3
    mixed, llm = generate(looping_dir, [prompt, *repetitive_prompts(10, 3)], [seeded, *others],
                          draft_spec(drafts["near"]))
    assert mixed[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert llm.engine.get_stats().spec_decode_num_drafts > 0  # the unseeded ones speculated beside it


def test_a_draft_equal_to_the_target_has_its_sampled_drafts_accepted(looping_dir: Path,  # noqa: F811
                                                                     drafts: dict[str, Path]) -> None:
    """With q = p (the target as its own draft, the same sampling settings) min(1, p/q) accepts every
    draft (to rounding); treating drafts as certain (q one-hot) would accept only sum p^2 of them."""
    params = SamplingParams(temperature=2.0, top_k=3, max_tokens=16, ignore_eos=True)
    _, llm = generate(looping_dir, repetitive_prompts(13, 4), params, draft_spec(drafts["self"]))
    accepted, proposed = acceptance(llm)
    assert proposed > 20 and accepted >= 0.98 * proposed, (accepted, proposed)
    assert_no_block_leaks(llm)


@pytest.mark.slow  # 1500 requests through the offline API, with a draft model: about three minutes
def test_sampled_tokens_follow_the_target_distribution(looping_dir: Path, drafts: dict[str, Path]  # noqa: F811
                                                       ) -> None:
    """Temperature 1, top-k 3, with a draft whose q differs from p: the joint distribution of the first
    three tokens equals the product of transformers' conditional probabilities."""
    seed_prompt = repetitive_prompts(11, 1)[0]
    greedy, _ = generate(looping_dir, [seed_prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                         None)
    prompt = seed_prompt + greedy[0].outputs[0].token_ids
    n = 1500
    # max_tokens 4: after the first token, two drafts are verified (both, one or none accepted).
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=4, ignore_eos=True)
    outs, llm = generate(looping_dir, [prompt] * n, params, draft_spec(drafts["near"], k=2))
    assert_first_tokens_follow_the_target(looping_dir, prompt, outs, depth=3, top_k=3)
    accepted, proposed = acceptance(llm)
    assert proposed >= 2 * n and 0.3 * proposed < accepted < proposed, (accepted, proposed)


def test_draft_model_config_is_checked_at_start(looping_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    spec = EngineConfig.create(model=str(looping_dir), device="cpu",
                               speculative_config={"model": str(looping_dir), "num_speculative_tokens": 2})
    assert spec.speculative is not None and spec.speculative.method == "draft_model"  # vLLM's inference
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text((looping_dir / "config.json").read_text().replace(
        '"vocab_size": ', '"vocab_size": 7'))
    with pytest.raises(ConfigError, match=rf"draft '{re.escape(str(other))}' has vocab_size 7\d+, the target '{re.escape(str(looping_dir))}'"):
        EngineConfig.create(model=str(looping_dir), device="cpu", speculative_config=draft_spec(other))
    with pytest.raises(ConfigError, match=r"'eagle'.*not implemented"):  # EAGLE-1, by vLLM's inference
        EngineConfig.create(model=str(looping_dir), device="cpu",
                            speculative_config={"model": "/x/EAGLE-head", "num_speculative_tokens": 2})


@pytest.mark.slow  # two worker processes over gloo
def test_greedy_draft_model_at_tp2_equals_plain_tp1(looping_dir: Path, drafts: dict[str, Path]) -> None:  # noqa: F811
    prompts = repetitive_prompts(8, 3)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    plain, _ = generate(looping_dir, prompts, params, None)
    spec, llm = generate(looping_dir, prompts, params, draft_spec(drafts["self"]), tensor_parallel_size=2)
    try:
        assert completions(spec) == completions(plain)
        assert_same_logprobs(plain, spec)
        assert_all_accepted(llm)
        assert_no_block_leaks(llm)
    finally:
        llm.engine.shutdown()


@pytest.mark.slow  # a `tandem serve` process
def test_tandem_serve_accepts_a_draft_model(looping_dir: Path, drafts: dict[str, Path], tmp_path: Path  # noqa: F811
                                            ) -> None:
    prompt = repetitive_prompts(12, 1)[0]
    plain, _ = generate(looping_dir, [prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), None)
    assert served_tokens(looping_dir, draft_spec(drafts["near"]), prompt, 16, tmp_path) == plain[0].outputs[0].token_ids
