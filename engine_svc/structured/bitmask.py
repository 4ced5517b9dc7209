"""The per-step token bitmask: filled on the driver for the constrained rows, applied by each worker.

`fill_bitmask` runs in `Scheduler.schedule()` for the constrained requests that sample this step (rows
of a partial prefill chunk sample nothing, so they get none) and packs the rows into the step's
`GrammarBitmask` (int32 words, bit t of a row = token t allowed, xgrammar's layout; a request verifying k
drafts has 1 + k rows: after each draft too, the drafts being ones the grammar allows). The struct travels
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

    def fill(self, req_ids: Sequence[str], grammars: Sequence[RequestGrammar],
             drafts: Sequence[list[int]] | None = None) -> GrammarBitmask:
        """The allowed next tokens of each grammar, in order: one row per request, or with `drafts` (a
        request's drafts verified this step) 1 + len(drafts) rows: the position after each draft too."""
        counts = [1 + len(d) for d in drafts] if drafts is not None else [1] * len(grammars)
        n = sum(counts)
        if self._buffer.shape[0] < n:
            self._buffer = torch.empty((max(n, 2 * self._buffer.shape[0]), self.num_words), dtype=torch.int32)
        row = 0
        for i, grammar in enumerate(grammars):
            if counts[i] == 1:
                grammar.fill(self._buffer, row)
            else:
                assert drafts is not None
                grammar.fill_positions(self._buffer, row, drafts[i])
            row += counts[i]
        rows = counts if any(c > 1 for c in counts) else []
        return GrammarBitmask(req_ids=list(req_ids), words=self._buffer[:n].numpy().tobytes(), rows=rows)


def apply_bitmask(logits: torch.Tensor, mask: GrammarBitmask, row_of: dict[str, int]) -> None:
    """Mask the logits rows of `mask.req_ids` to the allowed tokens, in place: a request's rows (one, or
    `mask.rows[i]` for one verifying drafts) go to the logits rows from `row_of[req_id]` on; ids not in
    `row_of` (not sampling in these logits) are skipped. Columns past the mask's words (none, when the
    mask was built for the model's vocab size) are left alone."""
    import xgrammar as xgr

    counts = mask.rows or [1] * len(mask.req_ids)
    total = sum(counts)
    num_words = len(mask.words) // (4 * total) if total else 0
    words = torch.from_numpy(np.frombuffer(mask.words, dtype=np.int32).reshape(-1, num_words).copy())
    word_rows: list[int] = []
    rows: list[int] = []
    start = 0
    for rid, count in zip(mask.req_ids, counts):
        first = row_of.get(rid)
        if first is not None:
            word_rows.extend(range(start, start + count))
            rows.extend(range(first, first + count))
        start += count
    if not rows:
        return
    # xgrammar indexes the bitmask and the logits with the same row: lay the bitmask out by logits row.
    full = torch.full((logits.shape[0], num_words), -1, dtype=torch.int32)
    full[rows] = words[word_rows] if len(word_rows) != total else words
    xgr.apply_token_bitmask_inplace(logits, full.to(logits.device, non_blocking=True), indices=rows)
