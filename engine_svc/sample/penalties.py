"""Logit adjustments that run before temperature: allowed_token_ids, bad words, min_tokens masking,
logit_bias and the three penalties.

Each function modifies `logits` ([B, V] float32) in place. Dense [R, V] count tensors are built only for
the R rows that have a penalty; masks and biases are sparse (one scattered write per entry), so a row
without any costs nothing.
"""

from __future__ import annotations

import torch

from engine_svc.sample.metadata import PenaltyMetadata


def apply_allowed_token_ids(logits: torch.Tensor, allowed: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """In rows `rows`, every logit becomes -inf except those of the row's allowed ids (vLLM's
    allowed_token_ids): entry j keeps logits[rows[entry_rows[j]], ids[j]]."""
    rows, entry_rows, ids = allowed
    sub = logits.index_select(0, rows)
    kept = torch.full_like(sub, float("-inf"))
    kept[entry_rows, ids] = sub[entry_rows, ids]
    logits.index_copy_(0, rows, kept)


def apply_token_mask(logits: torch.Tensor, mask: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Set logits[rows[j], ids[j]] = -inf: bad words' banned continuations, or the EOS / stop ids of rows
    that have not reached min_tokens."""
    rows, ids = mask
    logits.index_put_((rows, ids), torch.tensor(float("-inf"), device=logits.device))


def apply_logit_bias(logits: torch.Tensor, bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """logits[rows[j], ids[j]] += biases[j] (OpenAI / vLLM logit_bias; ids are distinct within a row)."""
    rows, ids, values = bias
    logits.index_put_((rows, ids), values.to(logits.dtype), accumulate=True)


def apply_penalties(logits: torch.Tensor, pm: PenaltyMetadata) -> None:
    """Penalise the rows `pm.rows` of `logits`.

    Per row, with `count[t]` = occurrences of t among the output tokens:
    - repetition (HF): for t in prompt ∪ output, logit > 0 -> logit / r, else logit * r;
    - then frequency / presence (OpenAI): logit -= frequency * count[t] + presence * (count[t] > 0).
    """
    num_rows, vocab = pm.rows.numel(), logits.shape[1]
    every_row = num_rows == logits.shape[0]  # rows are distinct and sorted, so this means all of them
    sub = logits if every_row else logits.index_select(0, pm.rows)
    counts = torch.zeros(num_rows, vocab, dtype=logits.dtype, device=logits.device)
    counts.index_put_(
        (pm.output_rows, pm.output_tokens),
        torch.ones((), dtype=logits.dtype, device=logits.device),
        accumulate=True,
    )
    seen = counts > 0
    if pm.repetition is not None:
        assert pm.prompt_rows is not None and pm.prompt_tokens is not None
        in_context = seen.clone()
        in_context[pm.prompt_rows, pm.prompt_tokens] = True
        r = pm.repetition.unsqueeze(1)
        penalised = torch.where(sub > 0, sub / r, sub * r)
        sub = torch.where(in_context, penalised, sub)
    sub = sub - (pm.frequency.unsqueeze(1) * counts + pm.presence.unsqueeze(1) * seen)
    if every_row:
        logits.copy_(sub)
    else:
        logits.index_copy_(0, pm.rows, sub)
