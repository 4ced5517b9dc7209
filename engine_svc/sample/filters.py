"""Truncation filters on temperature-scaled logits [B, V]: min-p, top-k, top-p.

A filtered-out token gets logit -inf (probability 0). Order (as vLLM V1): min-p on the scaled
distribution, then top-k, then top-p on the distribution renormalised after top-k. Each filter always
keeps the most likely token, and a disabled row (min_p 0, top_k 0, top_p 1) is left untouched.
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """In place: drop tokens whose probability is < min_p * (the row's max probability)."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    logits.masked_fill_(probs < threshold, _NEG_INF)


def _kth_largest(values_desc: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """[B, 1]: the top_k-th entry of each descending row, or -inf where top_k is 0 (disabled)."""
    kth = values_desc.gather(1, (top_k.clamp(min=1) - 1).unsqueeze(1))
    return kth.masked_fill_(top_k.unsqueeze(1) <= 0, _NEG_INF)


def apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor, top_k_max: int) -> None:
    """In place: keep tokens whose logit is >= the row's k-th largest (ties at the boundary kept)."""
    top_values = logits.topk(top_k_max, dim=-1).values
    logits.masked_fill_(logits < _kth_largest(top_values, top_k), _NEG_INF)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k (as `apply_top_k_only`), then top-p: in descending order, keep a token while the mass of
    the tokens before it is < top_p (the smallest prefix with mass >= top_p). Returns new logits."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        sorted_logits.masked_fill_(sorted_logits < _kth_largest(sorted_logits, top_k), _NEG_INF)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = mass_before >= top_p.unsqueeze(1)
    drop[:, 0] = False
    drop &= (top_p < 1.0).unsqueeze(1)  # rounding must not trim the tail of a disabled row
    sorted_logits.masked_fill_(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
