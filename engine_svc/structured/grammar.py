"""One request's grammar state: an xgrammar matcher that has accepted the request's output tokens."""

from __future__ import annotations

from typing import Any

import torch


class RequestGrammar:
    """The matcher of one engine request.

    Invariant: the matcher has accepted exactly the request's output tokens, in order (the scheduler
    calls `accept` for each sampled token before appending it). Stop tokens (the request's EOS ids) are
    allowed only where the grammar may end; once one is accepted the matcher is terminated and the
    request's rows are no longer masked.
    """

    __slots__ = ("_matcher",)

    def __init__(self, compiled: Any, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it (the state is unchanged)."""
        if self._matcher.is_terminated():
            return True
        return bool(self._matcher.accept_token(token_id))

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (all allowed once terminated)."""
        if self._matcher.is_terminated():
            bitmask[row].fill_(-1)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())
