"""Tests for engine_svc/sample: filters, penalties, min_tokens, logit_bias, seeds, greedy, logprobs, temperature."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from engine_svc.sample.logprobs import PROMPT_LOGPROBS_CHUNK, compute_prompt_logprobs
from engine_svc.sample.metadata import RequestSamplingState, build_sampling_metadata
from engine_svc.sample.penalties import apply_penalties
from engine_svc.sample.sampler import Sampler, scale_and_filter
from shared_runtime.contract import EngineSamplingParams

CPU = torch.device("cpu")
SETTINGS = settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.filter_too_much]
)
sampler = Sampler()


def state(
    vocab: int,
    prompt: list[int] | None = None,
    eos: list[int] | None = None,
    outputs: list[int] | None = None,
    **params,
) -> RequestSamplingState:
    return RequestSamplingState(
        EngineSamplingParams(**params), prompt or [0], eos or [], vocab, output_token_ids=outputs
    )


def sample(states: list[RequestSamplingState], logits: torch.Tensor):
    return sampler(logits, build_sampling_metadata(states, CPU))


# ---------------------------------------------------------------- filters (min-p, top-k, top-p)


def reference_allowed(
    logits: list[float], temperature: float, min_p: float, top_k: int, top_p: float
) -> tuple[set[int], float]:
    """The tokens the filters keep, in float64 with plain loops, and the smallest distance of any
    threshold comparison from its boundary (so ambiguous cases can be skipped)."""
    v = len(logits)
    scaled = [x / temperature for x in logits]
    top = max(scaled)
    probs = [math.exp(x - top) for x in scaled]  # unnormalised; ratios are what matter
    margin = math.inf
    keep = set(range(v))
    if min_p > 0:
        ratios = [p / max(probs) for p in probs]
        margin = min(margin, *(abs(r - min_p) for r in ratios))
        keep = {t for t in keep if ratios[t] >= min_p}
    if 0 < top_k < v and top_k < len(keep):
        by_value = sorted(keep, key=lambda t: -scaled[t])
        keep = set(by_value[:top_k])  # the test's logits are distinct, so no boundary ties
    if top_p < 1.0:
        total = sum(probs[t] for t in keep)
        ordered = sorted(keep, key=lambda t: -probs[t])
        mass_before, kept = 0.0, set()
        for t in ordered:
            margin = min(margin, abs(mass_before - top_p))
            if mass_before < top_p:
                kept.add(t)
            mass_before += probs[t] / total
        keep = kept
    return keep, margin


@SETTINGS
@given(
    data=st.data(),
    vocab=st.integers(2, 40),
    temperature=st.floats(0.2, 3.0),
    min_p=st.sampled_from([0.0, 0.0, 0.01, 0.1, 0.3, 0.7]),
    top_p=st.sampled_from([1.0, 1.0, 0.05, 0.3, 0.6, 0.9, 0.99]),
)
def test_filters_keep_exactly_the_reference_set_and_never_sample_outside(
    data, vocab, temperature, min_p, top_p
):
    grid = data.draw(st.lists(st.integers(-40, 40), min_size=vocab, max_size=vocab, unique=True))
    logits_row = [g * 0.25 for g in grid]
    top_k = data.draw(st.integers(0, vocab + 1))
    allowed, margin = reference_allowed(logits_row, temperature, min_p, top_k, top_p)
    assume(margin > 1e-4)

    rows = 48
    states = [
        state(vocab, temperature=temperature, min_p=min_p, top_k=top_k, top_p=top_p) for _ in range(rows)
    ]
    logits = torch.tensor([logits_row] * rows, dtype=torch.float32)
    meta = build_sampling_metadata(states, CPU)
    kept = torch.isfinite(scale_and_filter(logits.clone(), meta))
    for r in (0, rows - 1):
        assert set(kept[r].nonzero().flatten().tolist()) == allowed
    torch.manual_seed(len(grid))
    drawn = set(sampler(logits, meta).sampled_token_ids.tolist())
    assert drawn <= allowed


def test_top_k_keeps_ties_at_the_boundary():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    meta = build_sampling_metadata([state(5, top_k=2)], CPU)
    kept = torch.isfinite(scale_and_filter(logits.clone(), meta))[0]
    assert kept.tolist() == [True, False, True, True, False]


def test_disabled_filters_keep_every_token_even_tiny_ones():
    logits = torch.tensor([[0.0, -30.0, -60.0, 5.0]])
    meta = build_sampling_metadata([state(4, top_k=4, top_p=1.0, min_p=0.0), state(4, top_p=0.99)], CPU)
    assert meta.top_k is None and meta.min_p is None
    kept = torch.isfinite(scale_and_filter(logits.repeat(2, 1), meta))
    assert kept[0].all()
    assert kept[1].tolist() == [False, False, False, True]


# ---------------------------------------------------------------- penalties and min_tokens


@SETTINGS
@given(
    data=st.data(),
    vocab=st.integers(2, 30),
    num_rows=st.integers(1, 4),
)
def test_penalties_match_the_per_element_formula(data, vocab, num_rows):
    tokens = st.lists(st.integers(0, vocab - 1), max_size=12)
    penalty = st.sampled_from([0.0, 0.0, 0.5, -0.7, 1.3])
    rep_penalty = st.sampled_from([1.0, 1.0, 1.2, 0.8, 2.0])
    states, refs = [], []
    torch.manual_seed(vocab * 7 + num_rows)
    logits = torch.randn(num_rows, vocab) * 3
    logits[0, 0] = 0.0  # the logit == 0 case
    for _ in range(num_rows):
        prompt = data.draw(tokens.filter(bool))
        outputs = data.draw(tokens)
        pres, freq, rep = data.draw(penalty), data.draw(penalty), data.draw(rep_penalty)
        states.append(
            state(
                vocab,
                prompt=prompt,
                outputs=outputs,
                temperature=0.0,
                presence_penalty=pres,
                frequency_penalty=freq,
                repetition_penalty=rep,
            )
        )
        refs.append((prompt, outputs, pres, freq, rep))

    expected = logits.clone().double()
    for row, (prompt, outputs, pres, freq, rep) in enumerate(refs):
        for t in range(vocab):
            x = float(logits[row, t])
            count = outputs.count(t)
            if t in prompt or count:
                x = x / rep if x > 0 else x * rep
            expected[row, t] = x - freq * count - pres * (count > 0)

    meta = build_sampling_metadata(states, CPU)
    got = logits.clone()
    if meta.penalties is not None:
        apply_penalties(got, meta.penalties)
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6)
    out = sampler(logits, meta).sampled_token_ids
    assert out.tolist() == got.argmax(dim=1).tolist()


def test_penalty_output_buffer_tracks_appended_tokens():
    s = state(6, prompt=[1], frequency_penalty=1.0, temperature=0.0)
    logits = torch.zeros(1, 6)
    for step in range(70):  # crosses the buffer's growth point
        s.output_token_ids.append(step % 6)
        meta = build_sampling_metadata([s], CPU)
        got = logits.clone()
        apply_penalties(got, meta.penalties)
        counts = [s.output_token_ids.count(t) for t in range(6)]
        assert got[0].tolist() == [-float(c) for c in counts]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_holds_back_eos_and_stop_ids_then_releases_them(temperature):
    vocab, eos, stop = 10, 5, 7
    s = state(
        vocab,
        eos=[eos],
        min_tokens=3,
        stop_token_ids=[stop],
        ignore_eos=True,
        temperature=temperature,
        top_k=2,
    )
    logits = torch.full((1, vocab), -5.0)
    logits[0, eos], logits[0, stop], logits[0, 2] = 20.0, 19.0, 0.0
    torch.manual_seed(0)
    produced = []
    for _ in range(5):
        token = sample([s], logits).sampled_token_ids.item()
        produced.append(token)
        s.output_token_ids.append(token)
    assert all(t not in (eos, stop) for t in produced[:3])
    assert produced[3] in (eos, stop)
    if temperature == 0.0:
        assert produced[3:] == [eos, eos]


# ---------------------------------------------------------------- seeds


def _step_logits(request: int, step: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * request + step)
    return torch.randn(vocab, generator=g) * 2


def _run_batch(
    specs: dict[int, dict],
    order: list[int],
    steps: int,
    vocab: int,
    resumed: dict[int, list[int]] | None = None,
) -> dict[int, list[int]]:
    states = {r: state(vocab, outputs=(resumed or {}).get(r), **specs[r]) for r in order}
    for _ in range(steps):
        logits = torch.stack([_step_logits(r, len(states[r].output_token_ids), vocab) for r in order])
        tokens = sample([states[r] for r in order], logits).sampled_token_ids.tolist()
        for r, t in zip(order, tokens):
            states[r].output_token_ids.append(t)
    return {r: states[r].output_token_ids for r in order}


def test_seeded_requests_ignore_batch_composition_and_row_order():
    vocab, steps = 50, 8
    specs = {
        0: dict(seed=1234, temperature=0.9, top_p=0.95),
        1: dict(temperature=1.0),  # unseeded
        2: dict(seed=99, temperature=1.5, top_k=10, frequency_penalty=0.3),
        3: dict(temperature=0.0),  # greedy
        4: dict(seed=7, temperature=0.7, min_p=0.05, logprobs=2),
    }
    alone = {r: _run_batch(specs, [r], steps, vocab)[r] for r in (0, 2, 4)}
    torch.manual_seed(5)
    mixed = _run_batch(specs, [1, 4, 3, 0, 2], steps, vocab)
    torch.manual_seed(6)
    reordered = _run_batch(specs, [2, 0, 4], steps, vocab)
    for r in (0, 2, 4):
        assert mixed[r] == alone[r]
        assert reordered[r] == alone[r]
    # A different seed gives a different stream (the seed is actually used).
    other = _run_batch({0: dict(specs[0], seed=4321)}, [0], steps, vocab)[0]
    assert other != alone[0]


def test_seeded_request_resumed_after_preemption_continues_its_stream():
    vocab = 40
    specs = {0: dict(seed=2024, temperature=1.2)}
    full = _run_batch(specs, [0], 9, vocab)[0]
    resumed = _run_batch(specs, [0], 5, vocab, resumed={0: full[:4]})[0]
    assert resumed == full


# ---------------------------------------------------------------- greedy and fast path


def test_all_greedy_is_a_plain_argmax_with_lowest_index_ties():
    states = [state(6, temperature=0.0) for _ in range(3)]
    meta = build_sampling_metadata(states, CPU)
    assert meta.is_plain_greedy and meta.temperature is None and meta.penalties is None
    logits = torch.tensor(
        [[1.0, 3.0, 3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0], [-1.0, -2.0, -3.0, -4.0, -5.0, -0.5]]
    )
    out = sampler(logits, meta)
    assert out.sampled_token_ids.tolist() == [1, 0, 5]
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None and out.logprobs_lists() is None


def test_greedy_rows_inside_a_random_batch_take_the_argmax():
    torch.manual_seed(3)
    logits = torch.randn(6, 100)
    states = [state(100, temperature=0.0 if i % 2 == 0 else 1.0) for i in range(6)]
    meta = build_sampling_metadata(states, CPU)
    assert not meta.all_greedy and meta.greedy_rows is not None
    out = sampler(logits, meta).sampled_token_ids
    assert out[0::2].tolist() == logits[0::2].argmax(dim=1).tolist()


def test_cpu_rows_sample_without_a_vocabulary_of_exponentials(monkeypatch):
    """On CPU a random row draws one uniform, not V exponentials (torch's CPU exponential_ is a third
    of a 16-stream decode step) — seeded rows too, from their own stream."""
    def no_exponential(self, *args, **kwargs):
        raise AssertionError("a CPU row drew a vocabulary of exponentials")

    monkeypatch.setattr(torch.Tensor, "exponential_", no_exponential)
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]] * 4)
    states = [state(4, temperature=1.0), state(4, temperature=0.0), state(4, temperature=0.7),
              state(4, temperature=1.0, seed=3)]
    out = sample(states, logits)
    assert out.sampled_token_ids[1] == 2 and all(0 <= t < 4 for t in out.sampled_token_ids.tolist())


def test_seeded_cpu_rows_sample_the_distribution():
    """One seeded row per seed, a seed per row: the tokens are distributed as softmax(logits / T)."""
    logits_row = torch.tensor([0.0, 1.0, 2.0, -1.0])
    draws, temperature = 4000, 0.8
    states = [state(4, temperature=temperature, seed=seed) for seed in range(draws)]
    tokens = sample(states, logits_row.repeat(draws, 1)).sampled_token_ids
    freq = torch.bincount(tokens, minlength=4).double() / draws
    target = torch.softmax(logits_row.double() / temperature, dim=0)
    chi2 = float((draws * (freq - target) ** 2 / target).sum())
    assert chi2 < 16.3  # p = 0.001 with 3 degrees of freedom


@pytest.mark.parametrize("u", [0.0, 1.0 - 2.0**-53, 1.0])
def test_cpu_inverse_transform_picks_only_kept_tokens_at_both_ends_of_the_uniform(monkeypatch, u):
    """The uniform's extremes land on the first / last token the filters kept, never on a removed one:
    u * total is held below the total even where the product rounds up to it."""
    monkeypatch.setattr(torch, "rand", lambda shape, dtype: torch.full(shape, u, dtype=dtype))
    logits = torch.tensor([[-math.inf, 3.0, 1.0, 2.0, -math.inf, -math.inf],
                           [0.5, 0.25, 0.125, -math.inf, 1.0, -math.inf]])
    got = sample([state(6, temperature=1.0), state(6, temperature=1.0, top_k=3)], logits).sampled_token_ids
    assert got.tolist() == ([1, 0] if u == 0.0 else [3, 4])


def test_min_tokens_row_becomes_plain_once_released():
    s = state(8, eos=[2], min_tokens=2, temperature=0.0)
    assert not build_sampling_metadata([s], CPU).is_plain_greedy
    s.output_token_ids += [0, 1]
    assert build_sampling_metadata([s], CPU).is_plain_greedy


def test_callers_logits_are_not_modified():
    torch.manual_seed(0)
    logits = torch.randn(3, 20)
    before = logits.clone()
    states = [
        state(
            20,
            prompt=[1, 2],
            temperature=0.8,
            top_p=0.5,
            top_k=5,
            min_p=0.1,
            repetition_penalty=1.5,
            outputs=[3],
            min_tokens=4,
            logprobs=1,
            eos=[4],
        )
    ] * 3
    sample(states, logits)
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax_with_ranks_and_ordered_top_n():
    torch.manual_seed(11)
    vocab = 30
    logits = torch.randn(4, vocab) * 2
    logits[2, 5] = logits[2, 6] = logits[2].max() + 1.0  # a tie at the top
    states = [
        state(vocab, temperature=0.0),  # does not ask
        state(vocab, temperature=0.7, logprobs=0, repetition_penalty=2.0, prompt=[1, 2, 3]),
        state(vocab, temperature=0.0, logprobs=3, presence_penalty=5.0, outputs=[5]),
        state(vocab, temperature=1.3, logprobs=5, top_k=3),
    ]
    out = sample(states, logits)
    lists = out.logprobs_lists()
    assert lists is not None and lists[0] is None
    raw = torch.log_softmax(logits.double(), dim=1)
    sampled = out.sampled_token_ids.tolist()
    assert sampled[2] == 6  # the presence penalty on token 5 broke the tie
    for row, n in ((1, 0), (2, 3), (3, 5)):
        lp, rank, top_ids, top_lps = lists[row]
        tok = sampled[row]
        assert lp == pytest.approx(raw[row, tok].item(), abs=1e-6)
        assert rank == 1 + int((raw[row] > raw[row, tok] + 1e-9).sum())
        assert len(top_ids) == len(top_lps) == n
        assert top_lps == sorted(top_lps, reverse=True)
        expected_top = raw[row].sort(descending=True).values[:n].tolist()
        assert top_lps == pytest.approx(expected_top, abs=1e-6)
        assert [raw[row, t].item() for t in top_ids] == pytest.approx(top_lps, abs=1e-6)
    assert lists[2][1] == 1  # tied for the top: rank 1
    assert set(lists[2][2][:2]) == {5, 6}


def test_prompt_logprobs_small_case_by_hand():
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3], [0.2, 0.2, 0.6]]))
    targets = torch.tensor([2, 1, 0])
    rows = compute_prompt_logprobs(logits, targets, num_top=2)
    ln = math.log
    expected = [
        (2, ln(0.3), 2, [1, 2], [ln(0.6), ln(0.3)]),
        (1, ln(0.2), 3, [0, 2], [ln(0.5), ln(0.3)]),
        (0, ln(0.2), 2, [2], [ln(0.6)]),  # rank 2: the tie with token 1 is not strictly larger
    ]
    for got, want in zip(rows, expected):
        assert got[0] == want[0] and got[2] == want[2]
        assert got[1] == pytest.approx(want[1], abs=1e-6)
        assert got[3][: len(want[3])] == want[3]
        assert got[4][: len(want[4])] == pytest.approx(want[4], abs=1e-6)
    assert all(len(r[3]) == 2 for r in rows)
    assert compute_prompt_logprobs(logits, targets, num_top=0)[1][3] == []


# ---------------------------------------------------------------- temperature


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_reshapes_the_sampled_distribution(temperature):
    logits_row = torch.tensor([0.0, 1.0, 2.0, -1.0])
    draws = 6000
    states = [state(4, temperature=temperature)] * draws
    torch.manual_seed(42)
    tokens = sample(states, logits_row.repeat(draws, 1)).sampled_token_ids
    freq = torch.bincount(tokens, minlength=4).double() / draws
    target = torch.softmax(logits_row.double() / temperature, dim=0)
    untempered = torch.softmax(logits_row.double(), dim=0)
    chi2 = float((draws * (freq - target) ** 2 / target).sum())
    assert chi2 < 16.3  # p = 0.001 with 3 degrees of freedom
    assert (freq - target).abs().max() < 0.03
    assert (freq - untempered).abs().max() > 0.1


def test_prompt_logprobs_over_several_chunks_match_a_direct_computation():
    """From hidden states: the logits of at most PROMPT_LOGPROBS_CHUNK positions exist at a time."""
    torch.manual_seed(8)
    hidden = torch.randn(1100, 5)  # more rows than one internal chunk
    head = torch.randn(5, 7)
    logits = hidden @ head
    targets = torch.randint(0, 7, (1100,))
    shapes: list[int] = []

    def to_logits(h: torch.Tensor) -> torch.Tensor:
        shapes.append(h.shape[0])
        return h @ head

    rows = compute_prompt_logprobs(hidden, targets, num_top=3, to_logits=to_logits)
    assert max(shapes) == PROMPT_LOGPROBS_CHUNK and sum(shapes) == 1100
    lp = torch.log_softmax(logits, dim=1)
    assert len(rows) == 1100
    chunk = PROMPT_LOGPROBS_CHUNK
    for p in (0, chunk - 1, chunk, 1099):
        token, logprob, rank, top_ids, top_lps = rows[p]
        assert top_lps == pytest.approx(lp[p].topk(3).values.tolist(), abs=1e-6)
        assert token == targets[p].item()
        assert logprob == pytest.approx(lp[p, token].item(), abs=1e-6)
        assert rank == 1 + int((lp[p] > lp[p, token]).sum())
        assert top_ids == lp[p].topk(3).indices.tolist()


# ---------------------------------------------------------------- logit_bias


@SETTINGS
@given(data=st.data(), vocab=st.integers(2, 30), num_rows=st.integers(1, 5))
def test_greedy_with_logit_bias_is_the_argmax_of_logits_plus_bias(data, vocab, num_rows):
    """Reference: torch directly, logits + a dense bias row; rows without a bias are untouched."""
    logits = torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(vocab * 7 + num_rows))
    states, dense = [], torch.zeros(num_rows, vocab)
    for row in range(num_rows):
        bias = data.draw(st.dictionaries(st.integers(0, vocab - 1), st.floats(-100, 100), max_size=vocab))
        states.append(state(vocab, temperature=0.0, logit_bias=bias))
        for token, value in bias.items():
            dense[row, token] = value
    expected = logits + dense
    top2 = expected.topk(2, dim=-1).values
    assume(bool((top2[:, 0] - top2[:, 1] > 1e-4).all()))  # no near-tie for the argmax
    out = sample(states, logits.clone())
    assert out.sampled_token_ids.tolist() == expected.argmax(dim=-1).tolist()


def test_a_large_positive_bias_forces_its_token_for_random_rows_too():
    vocab = 50
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(3))
    forced = state(vocab, temperature=1.0, top_k=5, top_p=0.9, seed=1, logit_bias={41: 100.0})
    banned = state(vocab, temperature=0.0, logit_bias={int(logits[1].argmax()): -100.0})
    plain = state(vocab, temperature=0.0)
    for _ in range(20):
        out = sample([forced, banned, plain], logits.clone()).sampled_token_ids.tolist()
        assert out[0] == 41  # survives top-k / top-p: the bias comes before them
        assert out[1] == int(logits[1].topk(2).indices[1])  # the greedy token is banned: the runner-up
        assert out[2] == int(logits[2].argmax())


def test_logit_bias_costs_rows_without_one_nothing_and_leaves_logprobs_raw():
    vocab = 20
    plain = [state(vocab, temperature=0.0), state(vocab, temperature=0.0)]
    assert build_sampling_metadata(plain, CPU).is_plain_greedy  # no bias anywhere: a single argmax
    biased = [plain[0], state(vocab, temperature=0.0, logit_bias={3: 50.0, 7: -2.0}, logprobs=1)]
    meta = build_sampling_metadata(biased, CPU)
    assert meta.logit_bias is not None and not meta.is_plain_greedy
    rows, ids, values = meta.logit_bias
    assert (rows.tolist(), ids.tolist(), values.tolist()) == ([1, 1], [3, 7], [50.0, -2.0])  # the biased row only
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0))
    out = sampler(logits, meta)
    assert out.sampled_token_ids.tolist() == [int(logits[0].argmax()), 3]
    [_, (logprob, _, _, _)] = out.logprobs_lists()
    assert logprob == pytest.approx(float(torch.log_softmax(logits[1], -1)[3]))  # the model's, not biased


# ---------------------------------------------------------------- allowed_token_ids, bad words


def reference_bad_words_ban(bad_words: list[list[int]], output: list[int]) -> set[int]:
    """vLLM's apply_bad_words for one row, in plain Python: a word's last id is banned when the output
    ends with the ids before it (a one-id word always)."""
    banned = set()
    for word in bad_words:
        if len(word) > len(output) + 1:
            continue
        prefix = word[:-1]
        if not prefix or output[-len(prefix):] == prefix:
            banned.add(word[-1])
    return banned


@SETTINGS
@given(data=st.data(), vocab=st.integers(2, 30), num_rows=st.integers(1, 4))
def test_greedy_with_allowed_ids_and_bad_words_is_the_argmax_of_the_masked_logits(data, vocab, num_rows):
    """Reference: the dense mask of vLLM's semantics built with plain loops; each row is a request with or
    without either feature, so masked and unmasked rows share a batch."""
    logits = torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(vocab * 11 + num_rows))
    ids = st.integers(0, vocab - 1)
    states, expected = [], logits.clone()
    for row in range(num_rows):
        allowed = data.draw(st.lists(ids, max_size=vocab))
        output = data.draw(st.lists(ids, max_size=6))
        bad = data.draw(st.lists(st.lists(ids, min_size=1, max_size=3), max_size=4))
        assume(not allowed or set(allowed) - reference_bad_words_ban(bad, output))  # something is left
        states.append(state(vocab, temperature=0.0, outputs=output, allowed_token_ids=allowed,
                            bad_words_token_ids=bad))
        if allowed:
            keep = torch.full((vocab,), float("-inf"))
            keep[allowed] = expected[row, allowed]
            expected[row] = keep
        for token in reference_bad_words_ban(bad, output):
            expected[row, token] = float("-inf")
    top2 = expected.topk(min(2, vocab), dim=-1).values
    assume(vocab < 2 or bool(((top2[:, 0] - top2[:, 1]) > 1e-4).all()))
    out = sample(states, logits.clone())
    assert out.sampled_token_ids.tolist() == expected.argmax(dim=-1).tolist()


def test_allowed_ids_hold_for_random_rows_and_logprobs_stay_raw():
    vocab = 50
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(5))
    allowed = [3, 17, 29]
    restricted = state(vocab, temperature=1.5, seed=4, allowed_token_ids=allowed, logprobs=0)
    free = state(vocab, temperature=1.5, seed=4)
    seen = set()
    for _ in range(40):
        out = sample([restricted, free], logits.clone())
        token = out.sampled_token_ids.tolist()[0]
        assert token in allowed
        seen.add(token)
        restricted.output_token_ids.append(token)
        [(logprob, _, _, _), _] = out.logprobs_lists()
        assert logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[token]))  # raw distribution
    assert len(seen) > 1  # sampled among them, not pinned to one


def test_a_bad_word_bans_its_last_token_only_after_its_prefix():
    vocab = 10
    logits = torch.zeros(1, vocab)
    logits[0, 7] = 5.0  # the greedy token
    word = [4, 7]
    assert sample([state(vocab, temperature=0.0, outputs=[1], bad_words_token_ids=[word])],
                  logits.clone()).sampled_token_ids.tolist() == [7]  # the prefix 4 is not there: allowed
    assert sample([state(vocab, temperature=0.0, outputs=[1, 4], bad_words_token_ids=[word])],
                  logits.clone()).sampled_token_ids.tolist() != [7]  # after 4, 7 is banned
    assert sample([state(vocab, temperature=0.0, bad_words_token_ids=[[7]])],
                  logits.clone()).sampled_token_ids.tolist() != [7]  # a one-token word: always


def test_token_filters_keep_other_rows_plain():
    vocab = 20
    plain = state(vocab, temperature=0.0)
    assert build_sampling_metadata([plain, state(vocab, temperature=0.0)], CPU).is_plain_greedy
    meta = build_sampling_metadata([plain, state(vocab, temperature=0.0, allowed_token_ids=[9, 2])], CPU)
    assert meta.allowed_token_ids is not None and not meta.is_plain_greedy
    rows, entry_rows, ids = meta.allowed_token_ids
    assert (rows.tolist(), entry_rows.tolist(), ids.tolist()) == ([1], [0, 0], [2, 9])
    banning = state(vocab, temperature=0.0, bad_words_token_ids=[[5, 6]])
    assert build_sampling_metadata([banning, plain], CPU).is_plain_greedy  # no output ends with 5: nothing to ban
    banning.output_token_ids.append(5)
    meta = build_sampling_metadata([plain, banning], CPU)
    assert meta.bad_words_mask is not None and not meta.is_plain_greedy
    assert [t.tolist() for t in meta.bad_words_mask] == [[1], [6]]


@pytest.mark.parametrize("logprobs", [None, 2])
def test_a_temperature_below_1e_5_is_greedy_beside_random_rows(logprobs):
    """vLLM's _SAMPLING_EPS: rows at 5e-324 (inf after dividing, NaN probabilities) or 9.99e-6 take the
    argmax, in a batch whose other row samples; every logprob stays finite."""
    torch.manual_seed(3)
    logits = torch.randn(3, 50) * 5
    states = [state(50, temperature=1.0, top_p=0.9, logprobs=logprobs),
              state(50, temperature=5e-324, top_p=0.9, logprobs=logprobs),
              state(50, temperature=9.99e-6, top_k=5, logprobs=logprobs)]
    out = sample(states, logits)
    assert out.sampled_token_ids[1:].tolist() == logits[1:].argmax(dim=-1).tolist()
    if logprobs is not None:
        rows = out.logprobs_lists()
        assert all(math.isfinite(r[0]) and all(math.isfinite(x) for x in r[3]) for r in rows)
    alone = sample([state(50, temperature=5e-324, seed=7)], logits[:1])
    assert alone.sampled_token_ids.tolist() == [int(logits[0].argmax())]
