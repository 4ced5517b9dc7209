"""Logprobs of sampled and prompt tokens, from the RAW model distribution.

`log_softmax(logits)` in float32, before penalties, temperature and filters (vLLM V1's default).
rank(t) = 1 + the number of tokens with a strictly larger logprob than t (1 = the argmax, ties share).
Top-N lists are in descending logprob order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

SampleLogprob = tuple[float, int, list[int], list[float]]  # (logprob, rank, top ids, top logprobs)
PromptLogprob = tuple[int, float, int, list[int], list[float]]  # (token id, logprob, rank, top ids, top lps)

# Prompt logprobs are computed this many positions at a time, logits included, bounding the [chunk, V]
# temporaries (4 prompts x 2,000 positions x a 49,152 vocabulary at once added ~800 MB to the engine).
PROMPT_LOGPROBS_CHUNK = 256


@dataclass
class LogprobsTensors:
    """Logprobs of the rows that asked for them (`rows`, in batch order), still on device."""

    batch_size: int
    rows: list[int]  # batch rows that asked
    num_top: list[int]  # top-N asked for, per entry of rows
    logprobs: torch.Tensor  # [R] float32, of the token at each target
    ranks: torch.Tensor  # [R] int64
    top_ids: torch.Tensor  # [R, max N] int64
    top_logprobs: torch.Tensor  # [R, max N] float32

    def to_lists(self) -> list[SampleLogprob | None]:
        """Per batch row: (logprob, rank, top ids, top lps), or None for rows that did not ask.
        One device->host copy per tensor."""
        out: list[SampleLogprob | None] = [None] * self.batch_size
        lps, ranks = self.logprobs.tolist(), self.ranks.tolist()
        top_ids, top_lps = self.top_ids.tolist(), self.top_logprobs.tolist()
        for j, row in enumerate(self.rows):
            n = self.num_top[j]
            out[row] = (lps[j], ranks[j], top_ids[j][:n], top_lps[j][:n])
        return out


def gather_logprobs(logits: torch.Tensor, targets: torch.Tensor, max_top: int) -> tuple[torch.Tensor, ...]:
    """For raw `logits` [R, V] and `targets` [R]: (target logprobs [R], ranks [R], top ids [R, max_top],
    top logprobs [R, max_top])."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    target_lp = lp.gather(1, targets.unsqueeze(1))
    ranks = (lp > target_lp).sum(dim=1) + 1
    top_lps, top_ids = lp.topk(max_top, dim=1)
    return target_lp.squeeze(1), ranks, top_ids, top_lps


def sampled_logprobs(
    raw_logits: torch.Tensor, sampled: torch.Tensor, num_logprobs: list[int | None]
) -> LogprobsTensors:
    """Logprobs of the sampled tokens for the rows whose `num_logprobs` entry is not None."""
    rows = [i for i, n in enumerate(num_logprobs) if n is not None]
    num_top = [num_logprobs[i] or 0 for i in rows]
    if len(rows) == len(num_logprobs):
        logits, targets = raw_logits, sampled
    else:
        index = torch.tensor(rows, dtype=torch.int64, device=raw_logits.device)
        logits, targets = raw_logits.index_select(0, index), sampled.index_select(0, index)
    max_top = min(max(num_top), raw_logits.shape[1])
    lps, ranks, top_ids, top_lps = gather_logprobs(logits, targets, max_top)
    return LogprobsTensors(len(num_logprobs), rows, num_top, lps, ranks, top_ids, top_lps)


def compute_prompt_logprobs(
    rows: torch.Tensor, target_ids: torch.Tensor, num_top: int,
    to_logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[PromptLogprob]:
    """Prompt logprobs: row p of `rows` [P, ...] predicts `target_ids[p]` (the prompt token after it).

    `rows` are logits [P, V], or hidden states that `to_logits` turns into logits; either way at most
    `PROMPT_LOGPROBS_CHUNK` rows are turned into logits and log-softmaxed at a time.
    Returns one (token id, logprob, rank, top ids, top lps) per row, top lists of length min(num_top, V).
    """
    out: list[PromptLogprob] = []
    for start in range(0, rows.shape[0], PROMPT_LOGPROBS_CHUNK):
        stop = start + PROMPT_LOGPROBS_CHUNK
        logits = rows[start:stop] if to_logits is None else to_logits(rows[start:stop])
        targets = target_ids[start:stop].to(device=logits.device, dtype=torch.int64)
        lps, ranks, top_ids, top_lps = gather_logprobs(logits, targets, min(num_top, logits.shape[1]))
        out.extend(zip(targets.tolist(), lps.tolist(), ranks.tolist(), top_ids.tolist(), top_lps.tolist()))
    return out
