"""Verification of one step's drafts against the target model's logits (the worker's rejection sampler).

Input: the logits of every verifying request's 1 + k positions (position j scores the token after
draft j; position 0 the token after the last known one), the sampling metadata of those rows (each
request's state repeated on its rows), and the drafts. Output per request: its accepted drafts followed
by one token the target samples, 1 to k + 1 tokens.

- Greedy rows: the target token at each position is the argmax of the processed logits (what the plain
  sampler takes). Drafts are accepted while they equal it; the run ends with the target token at the
  first mismatch, or after the last draft with the bonus token. Token for token what plain greedy
  decoding produces.
- Random rows (Leviathan et al., vLLM's rejection sampler): with p the target distribution at a position
  (temperature, min-p, top-k, top-p applied as the plain sampler does) and q the proposer's, draft d is
  accepted with probability min(1, p(d) / q(d)); on rejection the position's token is drawn from
  norm(max(0, p - q)) and the run ends; after k acceptances a bonus token is drawn from p at the last
  position. Prompt lookup proposes d with certainty (q = one-hot at d, `draft_probs` None), so the
  acceptance probability is p(d) and the recovered distribution is p with d removed, renormalised; a
  draft model passes the q it drew each draft from. Each output token is then distributed exactly as p
  given the tokens before it, whatever q is, provided the draft was drawn from q.
- Seeded random rows: each position's token is sampled from p with the request's own stream and the
  drafts are accepted while they equal it (`_replace_seeded_runs`): the tokens of plain decoding.
- Position j of a request is scored as if drafts 0..j-1 were its output (penalties, bad words and
  min_tokens see them: the caller's metadata has one row state per position, spec_step.py), which is
  the only case in which position j's token is used.
"""

from __future__ import annotations

import torch

from engine_svc.sample.metadata import RequestSamplingState, SamplingMetadata
from engine_svc.sample.sampler import processed_logits, sample_seeded, scale_and_filter


def verify(logits: torch.Tensor, meta: SamplingMetadata, drafts: list[list[int]],
           draft_probs: torch.Tensor | None = None) -> list[list[int]]:
    """The run of output tokens of each request (see the module docstring). `logits` has
    sum(len(d) + 1 for d in drafts) rows, request after request; `meta` has one row per logits row.
    `draft_probs`: q, one row per logits row (a draft's row holds the distribution it was drawn from;
    bonus rows are ignored); None when every draft was proposed with certainty."""
    processed = logits if meta.is_plain_greedy else processed_logits(logits, meta)
    targets = processed.argmax(dim=-1)
    if meta.all_greedy:
        return _greedy_runs(targets.tolist(), drafts)
    probs = target_probs(processed, targets, meta)
    draft_ids = torch.tensor([t for d in drafts for t in (*d, -1)], dtype=torch.int64, device=logits.device)
    is_draft = draft_ids >= 0
    index = draft_ids.clamp_min(0).unsqueeze(1)
    p_draft = probs.gather(1, index).squeeze(1).to(torch.float64)
    uniform = torch.rand(p_draft.shape, dtype=torch.float64, device=probs.device)
    if draft_probs is None:  # q(d) = 1: accept with probability p(d); recover from p without d
        accepted = (uniform < p_draft) & is_draft
        residual = torch.where(is_draft.unsqueeze(1), probs.scatter(1, index, 0.0), probs)
    else:  # accept with probability min(1, p(d) / q(d)); recover from max(0, p - q)
        q_draft = draft_probs.gather(1, index).squeeze(1).to(torch.float64)
        accepted = (uniform * q_draft < p_draft) & is_draft
        residual = torch.where(is_draft.unsqueeze(1), (probs - draft_probs).clamp_min_(0.0), probs)
    recovered = sample_rows(residual, fallback=index.squeeze(1))
    runs = _random_runs(accepted.tolist(), recovered.tolist(), drafts)
    if meta.seeded:
        _replace_seeded_runs(runs, probs, drafts, dict(meta.seeded))
    return runs


def _replace_seeded_runs(runs: list[list[int]], probs: torch.Tensor, drafts: list[list[int]],
                         seeded: dict[int, RequestSamplingState]) -> None:
    """Seeded requests verify by sampling, not by the acceptance rule: position j's token is what the
    request's stream samples from p_j (`sample_seeded`: the draw plain decoding makes for that output
    token), and the run goes on while it equals draft j. Conditioned on the tokens before it, each
    position's token is distributed as p_j whatever was drafted (exact for any draft, with acceptance
    p(d) - the rule's own for prompt lookup), and the stream makes one draw per output token, as in
    plain decoding: a seeded request's tokens are those of plain decoding, speculation on or off,
    whatever else is in the batch."""
    start = 0
    for n, d in enumerate(drafts):
        state = seeded.get(start)
        if state is not None:
            run: list[int] = []
            for j in range(len(d) + 1):
                run.append(sample_seeded(probs[start + j : start + j + 1], state))
                if j == len(d) or run[-1] != d[j]:
                    break
            runs[n] = run
        start += len(d) + 1


def _greedy_runs(targets: list[int], drafts: list[list[int]]) -> list[list[int]]:
    runs: list[list[int]] = []
    start = 0
    for d in drafts:
        a = 0
        while a < len(d) and d[a] == targets[start + a]:
            a += 1
        runs.append([*d[:a], targets[start + a]])
        start += len(d) + 1
    return runs


def _random_runs(accepted: list[bool], recovered: list[int], drafts: list[list[int]]) -> list[list[int]]:
    runs: list[list[int]] = []
    start = 0
    for d in drafts:
        a = 0
        while a < len(d) and accepted[start + a]:
            a += 1
        runs.append([*d[:a], recovered[start + a]])
        start += len(d) + 1
    return runs


def target_probs(processed: torch.Tensor, targets: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution a request samples from per row (the target's here; a draft model's q likewise): softmax of the scaled, filtered logits; greedy rows (in a batch
    that mixes them with random ones) one-hot at their argmax, so the rule above accepts exactly the
    matching draft and otherwise yields the argmax."""
    probs = torch.softmax(scale_and_filter(processed, meta), dim=-1)
    if meta.greedy_rows is not None:
        one_hot = torch.zeros_like(probs).scatter_(1, targets.unsqueeze(1), 1.0)
        probs = torch.where(meta.greedy_rows.unsqueeze(1), one_hot, probs)
    return probs


def sample_rows(probs: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """One token per row with probability proportional to the row (unnormalised rows are fine). A row
    with no mass left (its draft held all of p, to rounding) yields `fallback`."""
    cdf = probs.to(torch.float64).cumsum_(dim=-1)
    total = cdf[:, -1:]
    point = torch.rand(total.shape, dtype=torch.float64, device=probs.device).mul_(total)
    point = torch.minimum(point, torch.nextafter(total, torch.zeros_like(total)))
    picked = torch.searchsorted(cdf, point, right=True).squeeze_(1).clamp_(max=probs.shape[1] - 1)
    return torch.where(total.squeeze(1) > 0, picked, fallback)
