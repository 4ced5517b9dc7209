"""The scheduler's draft proposer for each --speculative-config method.

`ngram` proposes real tokens on the scheduler's host thread (ngram.py). `draft_model` and `eagle3` cannot:
their drafts come from a model the workers run. For it the scheduler reserves the drafts' places instead
(`DraftModelSlots`: k `PENDING_DRAFT` tokens), so that it budgets and allocates 1 + k tokens exactly as
for prompt lookup; the worker runs the draft model at the start of that step and writes the real drafts
into the scheduled places before the target verifies them (engine_svc/worker/draft_step.py). Only the
number of places reaches the scheduler's bookkeeping; the verified run carries the real tokens back.
"""

from __future__ import annotations

from typing import Protocol

from engine_svc.spec.config import SpeculativeConfig
from engine_svc.spec.ngram import NgramProposer

PENDING_DRAFT = -1  # a draft place the worker's draft model fills in the step that verifies it


class Proposer(Protocol):
    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` drafts to follow `tokens` (possibly none)."""
        ...


class DraftModelSlots:
    """`draft_model`: always k places, filled by the workers' draft model in the step itself."""

    def propose(self, tokens: list[int], k: int) -> list[int]:
        return [PENDING_DRAFT] * k if k > 0 else []


def make_proposer(spec: SpeculativeConfig) -> Proposer:
    if spec.method in ("draft_model", "eagle3"):  # drafts made by the workers (an EAGLE-3 head: eagle3_step.py)
        return DraftModelSlots()
    return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
