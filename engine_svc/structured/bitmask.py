"""The per-step token bitmask: filled on the driver for the constrained rows, applied by each worker.

`fill_bitmask` runs in `Scheduler.schedule()` for the constrained requests that sample this step (rows
of a partial prefill chunk sample nothing, so they get none) and packs the rows into the step's
`GrammarBitmask` (int32 words, bit t of a row = token t allowed, xgrammar's layout). The struct travels
inside the `SchedulerOutput`, so with tensor parallelism the mask is computed once and every rank
applies the same rows. `apply_bitmask` masks those rows of the logits in place (disallowed -> -inf)
before the sampler runs: xgrammar's CPU kernel on CPU, its CUDA kernel on GPU (`indices` picks the
rows, so unconstrained rows are not touched). A step without constrained rows has no bitmask.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine_svc.sched.output import GrammarBitmask
from engine_svc.structured.grammar import RequestGrammar


class BitmaskFiller:
    """Owns one int32 buffer of [max rows, words] (reused every step)."""

    def __init__(self, vocab_size: int) -> None:
        self.num_words = -(-vocab_size // 32)
        self._buffer = torch.empty((0, self.num_words), dtype=torch.int32)

    def fill(self, req_ids: Sequence[str], grammars: Sequence[RequestGrammar]) -> GrammarBitmask:
        """The allowed next tokens of each grammar, one row per request, in order."""
        n = len(grammars)
        if self._buffer.shape[0] < n:
            self._buffer = torch.empty((max(n, 2 * self._buffer.shape[0]), self.num_words), dtype=torch.int32)
        for row, grammar in enumerate(grammars):
            grammar.fill(self._buffer, row)
        return GrammarBitmask(req_ids=list(req_ids), words=self._buffer[:n].numpy().tobytes())


def apply_bitmask(logits: torch.Tensor, mask: GrammarBitmask, row_of: dict[str, int]) -> None:
    """Mask the logits rows of `mask.req_ids` (row index from `row_of`; ids not sampling this step are
    skipped) to the allowed tokens, in place. Columns past the mask's words (none, when the mask was
    built for the model's vocab size) are left alone."""
    import xgrammar as xgr

    num_words = len(mask.words) // (4 * len(mask.req_ids)) if mask.req_ids else 0
    words = torch.from_numpy(np.frombuffer(mask.words, dtype=np.int32).reshape(-1, num_words).copy())
    picked = [(i, row_of[rid]) for i, rid in enumerate(mask.req_ids) if rid in row_of]
    if not picked:
        return
    if len(picked) != len(mask.req_ids):
        words = words[[i for i, _ in picked]]
    # xgrammar indexes the bitmask and the logits with the same row: lay the bitmask out by logits row.
    full = torch.full((logits.shape[0], num_words), -1, dtype=torch.int32)
    rows = [row for _, row in picked]
    full[rows] = words
    xgr.apply_token_bitmask_inplace(logits, full.to(logits.device, non_blocking=True), indices=rows)
