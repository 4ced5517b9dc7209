"""Acceptance counters of speculative decoding, cumulative over the engine's life (vLLM's
`spec_decode_num_drafts`, `_num_draft_tokens`, `_num_accepted_tokens`, `_num_accepted_tokens_per_pos`)."""

from __future__ import annotations


class SpecDecodeStats:
    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_drafts = 0  # verifications: one per request per step that carried drafts
        self.num_draft_tokens = 0  # draft tokens verified
        self.num_accepted_tokens = 0  # draft tokens accepted
        self.accepted_per_pos = [0] * num_speculative_tokens  # accepted drafts by position in the run

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verification: `num_accepted` of its `num_drafts` drafts were accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        per_pos = self.accepted_per_pos
        for i in range(num_accepted):
            per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accept_length(self) -> float:
        """Tokens a verification yields on average: its accepted drafts plus the one it samples."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
