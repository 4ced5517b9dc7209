"""The batched sampler: raw logits [B, V] in, one token per row out.

Pipeline (vLLM V1 semantics):
  1. logprobs, when asked, are taken from the raw logits (see logprobs.py);
  2. allowed_token_ids masks every other token, bad words mask their banned continuations, min_tokens
     masks EOS / stop ids, logit_bias is added, then repetition, frequency and presence penalties
     (penalties.py) - vLLM V1's order;
  3. greedy rows: argmax (ties -> lowest index);
  4. random rows: divide by temperature, min-p, top-k, top-p (filters.py), then sample with the
     exponential race: argmax(probs / q), q ~ Exp(1) i.i.d. — which picks token t with probability
     probs[t]. On CPU rows sample the same distribution by inverse transform (one uniform per row over
     the running sum of probs): V exponentials per row cost a third of a decode step there. Seeded
     rows draw from their own generator (one [V] exponential draw, or on CPU one uniform, per sampled
     token), so their tokens depend only on (seed, logits), never on the rest of the batch or their row.

When every row is plain greedy (no penalties, min_tokens, logit_bias, allowed_token_ids, bad words or
logprobs) the call is a single argmax.
The caller's logits tensor is never modified.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_svc.sample.filters import apply_min_p, apply_top_k_only, apply_top_k_top_p
from engine_svc.sample.logprobs import LogprobsTensors, SampleLogprob, sampled_logprobs
from engine_svc.sample.metadata import RequestSamplingState, SamplingMetadata
from engine_svc.sample.penalties import (
    apply_allowed_token_ids,
    apply_logit_bias,
    apply_penalties,
    apply_token_mask,
)


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64, on the logits' device
    logprobs: LogprobsTensors | None = None  # None when no row asked

    def logprobs_lists(self) -> list[SampleLogprob | None] | None:
        """Per row (logprob, rank, top ids, top lps) or None for rows that did not ask; None if none did."""
        return None if self.logprobs is None else self.logprobs.to_lists()


class Sampler:
    """Stateless; per-request state lives in RequestSamplingState, per-step state in SamplingMetadata."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        if meta.is_plain_greedy:
            return SamplerOutput(logits.argmax(dim=-1))
        raw_logits = logits
        logits = processed_logits(logits, meta)
        sampled = logits.argmax(dim=-1) if meta.all_greedy else _sample_random(logits, meta)
        lp = None
        if meta.num_logprobs is not None:
            lp = sampled_logprobs(raw_logits, sampled, meta.num_logprobs)
        return SamplerOutput(sampled, lp)


def processed_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """A float32 copy of `logits` with step 2 of the pipeline applied (masks, bias, penalties): the
    logits greedy rows take the argmax of and random rows scale and filter."""
    logits = logits.to(torch.float32, copy=True)
    if meta.allowed_token_ids is not None:
        apply_allowed_token_ids(logits, meta.allowed_token_ids)
    if meta.bad_words_mask is not None:
        apply_token_mask(logits, meta.bad_words_mask)
    if meta.min_tokens_mask is not None:
        apply_token_mask(logits, meta.min_tokens_mask)
    if meta.logit_bias is not None:
        apply_logit_bias(logits, meta.logit_bias)
    if meta.penalties is not None:
        apply_penalties(logits, meta.penalties)
    return logits


def _sample_random(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Sample every row (greedy rows, if any, take their argmax). Modifies `logits`."""
    greedy_tokens = logits.argmax(dim=-1) if meta.greedy_rows is not None else None
    probs = torch.softmax(scale_and_filter(logits, meta), dim=-1)
    if probs.device.type == "cpu":
        sampled = _sample_cpu(probs, meta)
    else:
        q = _exponential_noise(probs, meta)
        sampled = probs.div_(q).argmax(dim=-1)
    if greedy_tokens is not None:
        assert meta.greedy_rows is not None
        sampled = torch.where(meta.greedy_rows, greedy_tokens, sampled)
    return sampled


def scale_and_filter(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Temperature, then min-p, top-k, top-p: the logits random rows sample from (-inf = excluded).
    May modify `logits` and return it."""
    assert meta.temperature is not None
    logits.div_(meta.temperature.unsqueeze(1))
    if meta.min_p is not None:
        apply_min_p(logits, meta.min_p)
    if meta.top_p is not None:
        return apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    if meta.top_k is not None:
        apply_top_k_only(logits, meta.top_k, meta.top_k_max)
    return logits


def _sample_cpu(probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """CPU: every random row by inverse transform; seeded rows take their uniform from their own stream.

    Inverse transform: one float64 uniform u per row, and the token t with cdf[t-1] <= u * total <
    cdf[t] over the row's float64 running sum — token t with probability probs[t], as the race, but
    from one random number instead of V exponentials, which torch's CPU `exponential_` makes a large
    share of a decode step (BENCHMARKS.md, "Where the served decode step goes"). A zero-probability token has no
    width in the running sum, so it is never picked; u * total is kept below the total, so the pick
    is always inside the row."""
    point = torch.rand((probs.shape[0], 1), dtype=torch.float64)
    for row, state in meta.seeded or []:
        point[row] = state.draw_uniform(probs.device)
    return _inverse_transform(probs, point)


def _inverse_transform(probs: torch.Tensor, point: torch.Tensor) -> torch.Tensor:
    """Row r's token for the float64 uniform point[r, 0] (see `_sample_cpu`). Modifies `point`."""
    cdf = probs.to(torch.float64).cumsum_(dim=-1)
    total = cdf[:, -1:]
    point = torch.minimum(point.mul_(total), torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, point, right=True).squeeze_(1)


def sample_seeded(probs: torch.Tensor, state: RequestSamplingState) -> int:
    """The token a seeded request samples from `probs` ([1, V], its distribution at one position),
    making the next draw of its stream exactly as the batched sampler does for a seeded row (one
    uniform on CPU, one exponential race on other devices): the same (distribution, stream position)
    gives the same token here and there."""
    if probs.device.type == "cpu":
        return int(_inverse_transform(probs, state.draw_uniform(probs.device).view(1, 1))[0])
    q = state.draw_exponential(probs.shape[1], probs.device)
    return int((probs[0] / q.clamp_min_(torch.finfo(q.dtype).tiny)).argmax())


def _exponential_noise(probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Exp(1) noise shaped like `probs`: one batched draw for unseeded rows, per-request generators for
    seeded ones. Clamped away from 0 so that a zero probability never divides into NaN."""
    batch, vocab = probs.shape
    seeded = meta.seeded or []
    if len(seeded) == batch:
        q = torch.stack([state.draw_exponential(vocab, probs.device) for _, state in seeded])
    else:
        q = torch.empty_like(probs).exponential_()
        for row, state in seeded:
            q[row] = state.draw_exponential(vocab, probs.device)
    return q.clamp_min_(torch.finfo(q.dtype).tiny)
