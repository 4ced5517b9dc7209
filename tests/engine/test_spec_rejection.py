"""The speculative-decoding pieces without an engine: the rejection sampler against the target
distribution (chi-square over many replicated requests in one call), greedy runs against the argmax,
the prompt-lookup proposer against a brute-force search, and --speculative-config parsing."""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine_svc.config import ConfigError, EngineConfig
from engine_svc.sample.metadata import RequestSamplingState, build_sampling_metadata
from engine_svc.sample.sampler import Sampler
from engine_svc.spec.config import SpeculativeConfig, SpeculativeConfigError
from engine_svc.spec.ngram import NgramProposer
from engine_svc.spec.rejection import verify
from engine_svc.worker.spec_step import position_states
from shared_runtime.contract import EngineSamplingParams

V = 8


def chi2_critical(df: int, z: float = 3.719) -> float:
    """The chi-square quantile for `df` degrees of freedom at the normal quantile z (3.719: p = 1e-4),
    by the Wilson-Hilferty approximation (within 1% for df >= 3)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts: list[int], probs: list[float]) -> tuple[float, int]:
    """Pearson's statistic of `counts` against `probs` (cells with p = 0 must be empty) and its df."""
    n = sum(counts)
    stat, cells = 0.0, 0
    for c, p in zip(counts, probs):
        if p == 0:
            assert c == 0, "a token of zero probability was produced"
            continue
        stat += (c - n * p) ** 2 / (n * p)
        cells += 1
    return stat, cells - 1


def states(params: EngineSamplingParams, count: int) -> list[RequestSamplingState]:
    return [RequestSamplingState(params, [1, 2], [], V) for _ in range(count)]


def target_probs(logits: torch.Tensor, temperature: float, top_k: int = 0) -> torch.Tensor:
    scaled = logits / temperature
    if top_k:
        kth = scaled.topk(top_k).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    return torch.softmax(scaled, dim=-1)


@pytest.mark.parametrize("top_k", [0, 3])
def test_random_verification_preserves_the_target_distribution(top_k: int) -> None:
    """Drafts [d0, d1] of middling probability: output 0 must follow p0; given output 0 == d0 (accepted),
    output 1 must follow p1; given both accepted, the bonus token follows p2. Exact probabilities from
    the logits, 30000 requests verified in one call."""
    torch.manual_seed(0)
    n, drafts = 30000, [3, 5]
    base = torch.tensor([[1.0, 0.2, -0.5, 0.9, 0.0, 0.4, -1.0, 0.3],
                         [0.1, 0.5, 0.7, -0.2, 0.0, 1.1, 0.2, -0.4],
                         [0.6, -0.3, 0.2, 0.8, -0.1, 0.0, 0.9, 0.1]])
    logits = base.repeat(n, 1)
    params = EngineSamplingParams(temperature=0.8, top_k=top_k)
    meta = build_sampling_metadata(states(params, 3 * n), torch.device("cpu"))
    runs = verify(logits, meta, [list(drafts)] * n)
    p = target_probs(base, 0.8, top_k).tolist()
    assert all(1 <= len(r) <= 3 and r[: len(r) - 1] == drafts[: len(r) - 1] for r in runs)
    for pos in range(3):
        sample = [r[pos] for r in runs if len(r) > pos]
        stat, df = chi2([sample.count(t) for t in range(V)], p[pos])
        assert stat < chi2_critical(df), (pos, stat, df)
    # The acceptance rate of d0 is p0(d0) (q is one-hot): within 5 sigma.
    accepted = sum(len(r) > 1 for r in runs) / n
    assert abs(accepted - p[0][3]) < 5 * math.sqrt(p[0][3] * (1 - p[0][3]) / n)


def test_greedy_verification_is_the_argmax_prefix() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3 * 4, V)
    argmax = logits.argmax(-1).view(4, 3).tolist()
    drafts = [[argmax[0][0], argmax[0][1]],  # both accepted: bonus token
              [argmax[1][0], (argmax[1][1] + 1) % V],  # second rejected
              [(argmax[2][0] + 1) % V, argmax[2][1]],  # first rejected
              [argmax[3][0], argmax[3][1]]]
    meta = build_sampling_metadata(states(EngineSamplingParams(temperature=0.0), 12), torch.device("cpu"))
    runs = verify(logits, meta, drafts)
    assert runs == [argmax[0], argmax[1][:2], argmax[2][:1], argmax[3]]


def test_greedy_rows_beside_random_rows_stay_exact() -> None:
    """A batch mixing greedy and random requests: the greedy ones still take exactly the argmax prefix."""
    torch.manual_seed(2)
    logits = torch.randn(6, V)
    argmax = logits.argmax(-1).tolist()
    rows = states(EngineSamplingParams(temperature=0.0), 3) + states(EngineSamplingParams(temperature=1.0), 3)
    meta = build_sampling_metadata(rows, torch.device("cpu"))
    for _ in range(20):
        runs = verify(logits, meta, [[argmax[0], (argmax[1] + 1) % V], [1, 2]])
        assert runs[0] == argmax[:2]


def test_logit_bias_and_allowed_ids_apply_at_every_position() -> None:
    logits = torch.zeros(3, V)
    params = EngineSamplingParams(temperature=0.0, logit_bias={6: 5.0}, allowed_token_ids=[2, 6])
    meta = build_sampling_metadata(states(params, 3), torch.device("cpu"))
    assert verify(logits, meta, [[6, 2]]) == [[6, 6]]


def brute_force(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The longest suffix n-gram (n in [lo, hi]) seen earlier, its most recent occurrence's continuation."""
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_ngram_proposer_equals_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 30))]
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        k = rng.randint(1, 5)
        assert NgramProposer(lo, hi).propose(tokens, k) == brute_force(tokens, k, lo, hi), (tokens, lo, hi, k)


def test_speculative_config_parsing() -> None:
    spec = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (3, 4, 4)
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2}).prompt_lookup_min == 5
    for bad, named in (
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 9}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}',
         "prompt_lookup_max"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}', "lookahead"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "draft_model"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}', "disable_by_batch_size"),
        ("not json", "JSON"),
    ):
        with pytest.raises(SpeculativeConfigError, match=named):
            SpeculativeConfig.parse(bad)


def test_speculation_with_pipeline_parallelism_is_refused_naming_both_flags(llama_dir) -> None:
    with pytest.raises(ConfigError, match=r"--speculative-config.*--pipeline-parallel-size"):
        EngineConfig.create(model=str(llama_dir), pipeline_parallel_size=2, device="cpu",
                            speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_speculation_with_async_scheduling_is_accepted_and_still_checked(llama_dir) -> None:
    cfg = EngineConfig.create(model=str(llama_dir), async_scheduling=True,
                              speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')
    assert cfg.resolved_async_scheduling and cfg.speculative is not None  # test_spec_async.py runs it
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        EngineConfig.create(model=str(llama_dir), async_scheduling=True, speculative_config='{"method": "ngram"}')
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        EngineConfig.create(model=str(llama_dir), speculative_config='{"method": "ngram"}')


def plain_tokens(logits: torch.Tensor, state: RequestSamplingState, drafts: list[int]) -> list[int]:
    """What plain decoding samples at each of the 1 + len(drafts) positions, one step per position, the
    drafts before a position taken as the request's output (the oracle of a verification step)."""
    tokens = []
    for j in range(len(drafts) + 1):
        view = state if j == 0 else state.after_drafts(drafts[:j])
        meta = build_sampling_metadata([view], torch.device("cpu"))
        tokens.append(int(Sampler()(logits[j : j + 1], meta).sampled_token_ids[0]))
    return tokens


OUTPUT_DEPENDENT = {
    "frequency": EngineSamplingParams(temperature=0.0, frequency_penalty=4.0),
    "presence": EngineSamplingParams(temperature=0.0, presence_penalty=4.0),
    "repetition": EngineSamplingParams(temperature=0.0, repetition_penalty=8.0),
    "bad_words": EngineSamplingParams(temperature=0.0, bad_words_token_ids=[[3, 3], [3, 4, 5]]),
    "min_tokens": EngineSamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[3]),
}


@pytest.mark.parametrize("feature", OUTPUT_DEPENDENT)
def test_output_dependent_features_see_the_drafts_before_each_position(feature: str) -> None:
    """Token 3 leads every position (then 4, then 5): a penalty, a bad word or min_tokens moves the
    choice away from it only once the drafts before the position count as output. Drafts equal to what
    plain decoding takes one step at a time are all accepted; scoring every position with the state
    before the step rejects them."""
    logits = torch.tensor([[0.0, 0.1, 0.2, 3.0, 2.5, 2.0, 0.3, 0.0]]).repeat(5, 1)
    logits[0, 3] = 9.0  # position 0 takes 3 whatever the feature (min_tokens still holds 3 back there)
    state = RequestSamplingState(OUTPUT_DEPENDENT[feature], [1, 2], [], V, output_token_ids=[0, 6])
    expected = plain_tokens(logits, state, [])  # position 0
    for _ in range(4):  # each next draft = plain decoding's token after the ones before it
        expected = plain_tokens(logits, state, expected)[: len(expected) + 1]
    drafts = expected[:4]
    rows = position_states(state, drafts)
    runs = verify(logits, build_sampling_metadata(rows, torch.device("cpu")), [drafts])
    assert runs == [plain_tokens(logits, state, drafts)]
    assert len(runs[0]) == 5  # every draft accepted
    before_step = build_sampling_metadata([state] * 5, torch.device("cpu"))
    assert len(verify(logits, before_step, [drafts])[0]) < 5  # the drafts change what follows them


def test_seeded_verification_takes_the_tokens_and_draws_of_plain_decoding() -> None:
    """A seeded random request: verifying any drafts gives the tokens its stream gives plain decoding,
    position by position, and leaves the stream where plain decoding leaves it."""
    torch.manual_seed(3)
    logits = torch.randn(5, V)
    params = EngineSamplingParams(temperature=1.0, seed=11)
    reference = RequestSamplingState(params, [1], [], V)
    plain = [int(Sampler()(logits[j : j + 1], build_sampling_metadata([reference], torch.device("cpu")))
                 .sampled_token_ids[0]) for j in range(5)]
    for drafts in (plain[:4], [*plain[:2], (plain[2] + 1) % V, plain[3]], [(plain[0] + 1) % V] * 4):
        state = RequestSamplingState(params, [1], [], V)
        runs = verify(logits, build_sampling_metadata([state] * 5, torch.device("cpu")), [drafts])
        accepted = next((j for j in range(4) if drafts[j] != plain[j]), 4)
        assert runs == [plain[: accepted + 1]]
        # The stream moved one draw per output token: the next token is plain decoding's next one.
        after = RequestSamplingState(params, [1], [], V, output_token_ids=plain[: accepted + 1])
        nxt = logits[4:5]
        assert (Sampler()(nxt, build_sampling_metadata([state], torch.device("cpu"))).sampled_token_ids.tolist()
                == Sampler()(nxt, build_sampling_metadata([after], torch.device("cpu"))).sampled_token_ids.tolist())
