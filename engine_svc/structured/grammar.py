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

    def allowed_drafts(self, drafts: list[int]) -> int:
        """How many leading `drafts` the grammar allows from here (all, once terminated: the request then
        ends or ignores EOS; none when the drafts are not known yet, negative places). State unchanged."""
        if self._matcher.is_terminated():
            return len(drafts)
        accepted = 0
        for token in drafts:
            if token < 0 or not self._matcher.accept_token(token):
                break
            accepted += 1
            if self._matcher.is_terminated():
                break
        if accepted:
            self._matcher.rollback(accepted)
        return accepted

    def fill_positions(self, bitmask: torch.Tensor, row: int, drafts: list[int]) -> None:
        """Rows row .. row + len(drafts) of `bitmask`: the tokens allowed next, then after each draft in
        turn (drafts the grammar allows: `allowed_drafts`). State unchanged."""
        self.fill(bitmask, row)
        accepted = 0
        for j, token in enumerate(drafts):
            if not self._matcher.is_terminated():
                if not self._matcher.accept_token(token):
                    raise AssertionError(f"draft {token} is not allowed by the grammar")
                accepted += 1
            self.fill(bitmask, row + 1 + j)
        if accepted:
            self._matcher.rollback(accepted)

    @property
    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())
