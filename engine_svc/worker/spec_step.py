"""The model runner's side of speculative decoding: drafts into the batch, verification after the forward.

A verifying request is scheduled 1 + k tokens: its last known token and its k drafts
(`SchedulerOutput.scheduled_spec_decode_tokens`). `put_drafts` writes the drafts past the request's
known tokens in the persistent batch (its `num_tokens` stays: they are not its tokens; the scheduler's
next diff overwrites them with the tokens it accepts). After the forward, `verified_output` turns the
hidden states of all 1 + k positions of each verifying request into logits and runs the rejection sampler
(engine_svc/spec/rejection.py) on them, with the draft model's q when drafts came from one (draft_step.py); the other sampling requests of the step sample as in a plain step,
through the runner's own sampler. Verification steps have queries longer than one token, so they never
replay a decode CUDA graph. Under async scheduling the drafts are the runner's own (spec_async.py: prompt
lookup may fill fewer than the step's places; a request with places but no drafts samples as a plain row
and its run is that one token), and with TP every rank takes rank 0's runs.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from engine_svc.distributed.parallel_state import get_tp_size, tensor_model_parallel_broadcast
from engine_svc.sample.logprobs import sampled_logprobs
from engine_svc.sample.metadata import (
    OUTPUT_FEATURES,
    RequestSamplingState,
    SamplingMetadata,
    build_sampling_metadata,
)
from engine_svc.sample.sampler import Sampler
from engine_svc.sched.output import ModelRunnerOutput, SchedulerOutput
from engine_svc.spec.rejection import verify
from engine_svc.structured.bitmask import apply_bitmask
from engine_svc.worker.draft_step import DraftRunner
from engine_svc.worker.input_batch import InputBatch, StepInputs
from engine_svc.worker.sampled_feed import PlaceholderFeed
from engine_svc.worker.staging import StepStaging


class Runner(Protocol):
    """What verification uses of the model runner (engine_svc/worker/model_runner.py `ModelRunner`)."""

    model: Any
    sampler: Sampler
    sampling_states: dict[str, RequestSamplingState]
    device: torch.device
    staging: StepStaging
    drafter: DraftRunner | None
    feed: PlaceholderFeed | None

    def _sampling_metadata(self, sample_ids: list[str], batch_rows: np.ndarray) -> SamplingMetadata: ...


def put_drafts(batch: InputBatch, drafts: dict[str, list[int]]) -> None:
    """Write each request's drafts right after its known tokens (positions the step computes)."""
    for req_id, tokens in drafts.items():
        row = batch.row_of[req_id]
        end = int(batch.num_tokens[row])
        batch.token_ids[row, end : end + len(tokens)] = tokens


def verified_output(runner: Runner, so: SchedulerOutput, drafts_of: dict[str, list[int]], inputs: StepInputs,
                    sample_idx: np.ndarray, hidden: torch.Tensor, prompt_logprobs: dict[str, list]
                    ) -> ModelRunnerOutput:
    """The step's output when some requests have draft places (see the module docstring); `drafts_of`:
    the drafts this runner put in them (fewer, or none, when prompt lookup under async scheduling found
    fewer). A request with places but no drafts samples as a plain row, and its run is that one token.
    Must run between the runner's `staging.begin_step()` and `end_step()`; ends the staging step itself."""
    places = so.scheduled_spec_decode_tokens
    req_ids, ends = inputs.req_ids, inputs.query_start_loc[1:]
    plain = [i for i in sample_idx.tolist() if not drafts_of.get(req_ids[i])]
    verifying = [i for i in sample_idx.tolist() if drafts_of.get(req_ids[i])]
    drafts = [drafts_of[req_ids[i]] for i in verifying]
    # Hidden rows: each plain request's last position, then each verifying request's 1 + k positions.
    index = [int(ends[i]) - 1 for i in plain]
    for i, d in zip(verifying, drafts):
        index.extend(range(int(ends[i]) - 1 - len(d), int(ends[i])))
    plain_ids = [req_ids[i] for i in plain]
    plain_meta = runner._sampling_metadata(plain_ids, inputs.rows[plain]) if plain else None
    runner.staging.end_step()
    logits = runner.model.compute_logits(hidden.index_select(0, torch.tensor(index, device=hidden.device)))

    sampled = [-1] * len(req_ids)
    logprobs: list | None = None
    if plain_meta is not None:
        plain_logits = logits[: len(plain)]
        if so.grammar is not None:
            apply_bitmask(plain_logits, so.grammar, {r: j for j, r in enumerate(plain_ids)})
        out = runner.sampler(plain_logits, plain_meta)
        rows = out.logprobs_lists()
        for j, (i, token) in enumerate(zip(plain, out.sampled_token_ids.tolist())):
            sampled[i] = token
            if rows is not None:
                logprobs = logprobs or [None] * len(req_ids)
                logprobs[i] = rows[j]

    spec_tokens: dict[str, list[int]] = {}
    spec_logprobs: dict[str, list] = {}
    if verifying:
        states = runner.sampling_states
        expanded = [row for i, d in zip(verifying, drafts) for row in position_states(states[req_ids[i]], d)]
        meta = build_sampling_metadata(expanded, runner.device)
        spec_logits = logits[len(plain):]
        ver_ids = [req_ids[i] for i in verifying]
        if so.grammar is not None:  # a constrained request's rows: masked after each draft (the scheduler's)
            starts = np.cumsum([0, *(len(d) + 1 for d in drafts[:-1])]).tolist()
            apply_bitmask(spec_logits, so.grammar, dict(zip(ver_ids, starts)))
        draft_probs = runner.drafter.draft_probs(ver_ids, drafts) if runner.drafter is not None else None
        runs = verify(spec_logits, meta, drafts, draft_probs)
        for i, run in zip(verifying, runs):
            sampled[i] = run[0]
            spec_tokens[req_ids[i]] = run
        spec_logprobs = _run_logprobs(spec_logits, meta, drafts, runs, req_ids, verifying)
    for i in plain:  # places without drafts: a run of the one token sampled
        if req_ids[i] in places:
            spec_tokens[req_ids[i]] = [sampled[i]]
            if logprobs is not None and logprobs[i] is not None:
                spec_logprobs[req_ids[i]] = [logprobs[i]]
    if runner.feed is not None and get_tp_size() > 1:
        _runs_of_rank0(sampled, spec_tokens, req_ids, sample_idx, places, runner.device)
    num_drafts = {r: len(drafts_of.get(r, ())) for r, p in places.items() if len(drafts_of.get(r, ())) != len(p)}
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, logprobs=logprobs,
                             prompt_logprobs=prompt_logprobs, spec_token_ids=spec_tokens,
                             spec_logprobs=spec_logprobs, spec_num_drafts=num_drafts)


def _runs_of_rank0(sampled: list[int], runs: dict[str, list[int]], req_ids: list[str], sample_idx: np.ndarray,
                   places: dict[str, list[int]], device: torch.device) -> None:
    """Async scheduling with TP: every rank takes rank 0's tokens and runs (in place), since each rank
    feeds its own next step from them (spec_async.py). One broadcast of a [sampling rows, 1 + max
    places] tensor, -1 padded; its shape follows from the step, the same on every rank."""
    width = 1 + max(len(p) for p in places.values())
    rows = sample_idx.tolist()
    table = torch.full((len(rows), width), -1, dtype=torch.int64)
    for j, i in enumerate(rows):
        run = runs.get(req_ids[i], [sampled[i]])
        table[j, : len(run)] = torch.tensor(run, dtype=torch.int64)
    table = table.to(device)
    tensor_model_parallel_broadcast(table)
    for j, row in enumerate(table.tolist()):
        i = rows[j]
        run = [t for t in row if t >= 0]
        sampled[i] = run[0]
        if req_ids[i] in runs:
            runs[req_ids[i]] = run


def position_states(state: RequestSamplingState, drafts: list[int]) -> list[RequestSamplingState]:
    """The sampling state each of a verifying request's 1 + len(drafts) positions is scored with: its
    own at position 0 (the one that draws, when seeded), and at position j its state after drafts
    0..j-1 when a feature reads the output so far (the same object everywhere otherwise)."""
    if not state.features & OUTPUT_FEATURES:
        return [state] * (len(drafts) + 1)
    return [state, *(state.after_drafts(drafts[:j]) for j in range(1, len(drafts) + 1))]


def _run_logprobs(logits: torch.Tensor, meta: SamplingMetadata, drafts: list[list[int]], runs: list[list[int]],
                  req_ids: list[str], verifying: list[int]) -> dict[str, list]:
    """Logprobs (from the raw logits, as the plain sampler takes them) of every token of each run, for
    the verifying requests that ask for them."""
    num_logprobs = meta.num_logprobs
    if num_logprobs is None:
        return {}
    chosen: list[int] = []
    for d, run in zip(drafts, runs):
        chosen.extend(run + [0] * (len(d) + 1 - len(run)))
    rows = sampled_logprobs(logits, torch.tensor(chosen, device=logits.device), num_logprobs).to_lists()
    result: dict[str, list] = {}
    start = 0
    for i, d, run in zip(verifying, drafts, runs):
        if num_logprobs[start] is not None:
            result[req_ids[i]] = rows[start : start + len(run)]
        start += len(d) + 1
    return result
