"""Speculative decoding under async scheduling, on the worker: runs expanded, positions corrected, drafts made.

Under async scheduling the scheduler lays out step N+1 before it has seen step N's output. For a request
that verified drafts in step N it cannot know how many were accepted, so it schedules step N+1 as if all
were (engine_svc/sched/scheduler.py): the request's diff carries one `PLACEHOLDER_TOKEN` for step N's
whole run and a `num_computed_tokens` that still counts step N's rejected draft places; its new draft
places are `PENDING_DRAFT`s. This worker verified step N itself and keeps every verified request's run
(`record`), so when step N+1's diff arrives it:

1. `expand`s the placeholder into the run on the host: the accepted drafts and the target's token are
   appended to the persistent batch and the sampling state, and `num_computed` loses the rejected places
   (the position correction: the step's positions, slots and sequence lengths follow from it);
2. proposes the drafts of the step's places (`propose`): prompt lookup over the request's tokens in the
   persistent batch (a draft model or an EAGLE-3 head proposes in draft_step.py / eagle3_step.py as
   without async scheduling). Prompt lookup may find fewer drafts than places (or none): the request then
   runs 1 + its drafts tokens, and its run says how many the scheduler must give back.

Verification reads its run on the host (the rejection sampler's result), so a step that verifies ends
with a device -> host sync, and a step whose speculating requests had a plain sample in flight waits for
that sample on the host before it proposes (`needs_host_tokens`). The scheduler's side overlaps as it does
without speculation: step N+1 is scheduled, and step N's output applied, while the worker runs.

Invariant: a placeholder of a request in `runs` stands for that run (the scheduler sends one only for the
step this worker ran last, and only one per request); `runs` holds the verified requests of this worker's
last step that sampled, and nothing older. With TP every rank expands rank 0's runs (broadcast in
spec_step.py), so the ranks' histories, and their prompt-lookup drafts, stay identical.
"""

from __future__ import annotations

from engine_svc.spec.ngram import NgramProposer
from engine_svc.worker.input_batch import InputBatch


class AsyncSpeculation:
    """The worker's verified runs of its last step and, for prompt lookup, its proposer."""

    def __init__(self, proposer: NgramProposer | None) -> None:
        self.proposer = proposer  # None: drafts come from a draft model / EAGLE-3 head
        self.runs: dict[str, tuple[list[int], int]] = {}  # request -> (run, draft places) of the last step

    def record(self, runs: dict[str, list[int]], places: dict[str, list[int]]) -> None:
        """The runs of the step just verified replace the last step's (`places`: its scheduled places)."""
        self.runs = {r: (run, len(places[r])) for r, run in runs.items()}

    def clear(self) -> None:
        """A step that verified nothing sampled: no placeholder of the next step stands for a run."""
        if self.runs:
            self.runs = {}

    def expand(self, batch: InputBatch, req_id: str) -> list[int] | None:
        """If `req_id` verified in the last step: its placeholder (the last token appended to the batch)
        becomes that run, `num_computed` loses the rejected places; returns the run (None: not verified)."""
        entry = self.runs.pop(req_id, None)
        if entry is None:
            return None
        run, places = entry
        row = batch.row_of[req_id]
        at = int(batch.num_tokens[row]) - 1
        batch.token_ids[row, at : at + len(run)] = run
        batch.num_tokens[row] = at + len(run)
        batch.num_computed[row] -= places - (len(run) - 1)
        return run

    def propose(self, batch: InputBatch, places: dict[str, list[int]]) -> dict[str, list[int]]:
        """Prompt-lookup drafts for the step's places: up to len(places[r]) per request (maybe none)."""
        assert self.proposer is not None
        drafts: dict[str, list[int]] = {}
        for req_id, slots in places.items():
            row = batch.row_of[req_id]
            drafts[req_id] = self.proposer.propose(batch.token_ids[row, : int(batch.num_tokens[row])].tolist(),
                                                   len(slots))
        return drafts
