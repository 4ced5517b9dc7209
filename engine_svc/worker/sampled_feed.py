"""Async scheduling on the worker: one step's sampled ids feed the next step's inputs on the device.

Under async scheduling the scheduler plans step N+1 before it has seen step N's sampled tokens, so a diff
may append `PLACEHOLDER_TOKEN` (engine_svc/sched/output.py): the last token of a decode, which this worker
sampled itself in its previous step. Per step (ModelRunner.execute_model):

1. `_update_states` writes the placeholder into the persistent batch like any token and tells the feed
   where it went (`note`);
2. `fill_for` (after the inputs are staged) overwrites those positions of the device input ids with the
   previous step's sampled ids, a gather on the device: the ids never make a round trip through the host;
3. `resolve` (once the forward is queued) waits for the previous step's host copy and writes the values
   where the host keeps tokens: the persistent batch and each request's sampling state (penalties,
   min_tokens and bad words read them), before this step's sampling metadata is built;
4. `record` keeps this step's sampled ids (`SampledStep`) for the next step, and starts their copy to the
   host (pinned memory, non-blocking, one event) that `PendingOutput.get` and the next `resolve` wait for.

Invariant: a placeholder in step N+1 stands for the token its request sampled in step N, the step this
worker ran last (with steps that sampled nothing in between kept out: they do not replace `prev`). The
scheduler sends a placeholder only for a sample of the step in flight while it schedules, and this worker
runs the steps in the order scheduled. A placeholder without a sample in the previous step is a broken
invariant and raises.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from engine_svc.sample.logprobs import LogprobsTensors
from engine_svc.sample.metadata import RequestSamplingState
from engine_svc.sched.output import ModelRunnerOutput
from engine_svc.worker.input_batch import InputBatch, StepInputs
from engine_svc.worker.staging import StepStaging

Fill = Callable[[torch.Tensor], None]


class SampledStep:
    """One step's sampled ids, in sampling order: on the device (`tokens`), and on their way to the host."""

    def __init__(self, tokens: torch.Tensor, logprobs: LogprobsTensors | None) -> None:
        self.tokens = tokens
        if tokens.device.type == "cuda":
            self._host = _pinned_copy(tokens)
            self.logprobs = logprobs if logprobs is None else _logprobs_to_host(logprobs)
            self._event: torch.cuda.Event | None = torch.cuda.Event()
            self._event.record()
        else:
            self._host, self.logprobs, self._event = tokens, logprobs, None
        self._values: np.ndarray | None = None

    def ready(self) -> bool:
        """Whether the host copy has arrived (never waits)."""
        return self._event is None or self._values is not None or self._event.query()

    def values(self) -> np.ndarray:
        """The sampled ids on the host (waits for the copy, once)."""
        if self._values is None:
            if self._event is not None:
                self._event.synchronize()
            self._values = self._host.numpy()
        return self._values


class PendingOutput:
    """A step's `ModelRunnerOutput` whose sampled ids (and logprobs) may still be on their way from the
    device: `get()` waits for them. The executor calls it where the engine wants the output."""

    def __init__(self, req_ids: list[str], sample_idx: np.ndarray | None, step: SampledStep,
                 prompt_logprobs: dict[str, list]) -> None:
        self.req_ids = req_ids
        self.sample_idx = sample_idx  # the sampling requests' indices into req_ids; None: every one
        self.step = step
        self.prompt_logprobs = prompt_logprobs
        self.lora_ready: list[int] = []  # set by the worker: ModelRunnerOutput's fields of the same names
        self.lora_failed: dict[int, str] = {}

    def ready(self) -> bool:
        """Whether `get()` would return without waiting for the device."""
        return self.step.ready()

    def get(self) -> ModelRunnerOutput:
        values = self.step.values().tolist()
        logprobs = self.step.logprobs.to_lists() if self.step.logprobs is not None else None
        if self.sample_idx is None:
            sampled = values
        else:
            sampled = [-1] * len(self.req_ids)
            full = None if logprobs is None else [None] * len(self.req_ids)
            for j, i in enumerate(self.sample_idx.tolist()):
                sampled[i] = values[j]
                if full is not None and logprobs is not None:
                    full[i] = logprobs[j]
            logprobs = full
        return ModelRunnerOutput(req_ids=self.req_ids, sampled_token_ids=sampled, logprobs=logprobs,
                                 prompt_logprobs=self.prompt_logprobs, lora_ready=self.lora_ready,
                                 lora_failed=self.lora_failed)


def as_runner_output(out: ModelRunnerOutput | PendingOutput) -> ModelRunnerOutput:
    """A worker's step result as a `ModelRunnerOutput` (waiting for a pending one)."""
    return out.get() if isinstance(out, PendingOutput) else out


class PlaceholderFeed:
    """The worker's side of async scheduling (see the module docstring); one per model runner."""

    def __init__(self, max_rows: int) -> None:
        self.prev: SampledStep | None = None
        self._index_of_row = np.full(max_rows, -1, dtype=np.int64)  # batch row -> index into prev.tokens
        self._prev_rows = np.zeros(0, dtype=np.int64)
        # This step's placeholders: batch rows, positions, request ids (in the order noted).
        self._rows: list[int] = []
        self._positions: list[int] = []
        self._req_ids: list[str] = []

    def note(self, req_id: str, row: int, position: int) -> None:
        """A placeholder was written at `position` of `row` (request `req_id`) this step."""
        self._rows.append(row)
        self._positions.append(position)
        self._req_ids.append(req_id)

    @property
    def num_noted(self) -> int:
        return len(self._rows)

    def fill_for(self, inputs: StepInputs, staging: StepStaging) -> Fill | None:
        """What writes the previous step's sampled ids over this step's placeholder input ids, on the
        device (None when the step has none). Stages its indices now; call after `begin_step`."""
        if not self._rows:
            return None
        prev = self._require_prev()
        rows = np.asarray(self._rows, dtype=np.int64)
        src = self._index_of_row[rows]
        if (src < 0).any():
            bad = self._req_ids[int(np.flatnonzero(src < 0)[0])]
            raise RuntimeError(f"placeholder token for request {bad!r}, which sampled nothing in the "
                               "worker's previous step (async scheduling invariant broken)")
        slot_of_row = np.full(len(self._index_of_row), -1, dtype=np.int64)
        slot_of_row[inputs.rows] = np.arange(len(inputs.rows))
        slots = slot_of_row[rows]
        offsets = np.asarray(self._positions, dtype=np.int64) - (inputs.seq_lens[slots] - inputs.query_lens[slots])
        if (slots < 0).any() or (offsets < 0).any() or (offsets >= inputs.query_lens[slots]).any():
            raise RuntimeError("a placeholder token lies outside the tokens scheduled this step")
        flat = inputs.query_start_loc[slots] + offsets
        n = len(flat)
        tokens = prev.tokens
        if n == len(inputs.input_ids) and n <= tokens.numel() and _is_arange(flat) and _is_arange(src):
            return lambda ids: ids[:n].copy_(tokens[:n])  # the steady decode: the previous step's order
        index = staging.stage_arrays([np.stack([flat, src])])[0]
        return lambda ids: ids.index_copy_(0, index[0], tokens.index_select(0, index[1]))

    def resolve(self, batch: InputBatch, states: dict[str, RequestSamplingState]) -> None:
        """Write this step's placeholders' values (the previous step's sampled ids, waited for) into the
        persistent batch and the requests' sampling states; forget the notes."""
        if not self._rows:
            return
        prev = self._require_prev()
        rows = np.asarray(self._rows, dtype=np.int64)
        values = prev.values()[self._index_of_row[rows]]
        batch.token_ids[rows, np.asarray(self._positions, dtype=np.int64)] = values
        for req_id, value in zip(self._req_ids, values.tolist()):
            states[req_id].output_token_ids.append(value)
        self._rows, self._positions, self._req_ids = [], [], []

    def record(self, tokens: torch.Tensor, rows: np.ndarray, logprobs: LogprobsTensors | None) -> SampledStep:
        """This step's sampled ids (`tokens[j]` sampled for batch row `rows[j]`) become `prev`."""
        self._index_of_row[self._prev_rows] = -1
        self._index_of_row[rows] = np.arange(len(rows))
        self._prev_rows = np.array(rows, dtype=np.int64)
        self.prev = SampledStep(tokens, logprobs)
        return self.prev

    def _require_prev(self) -> SampledStep:
        if self.prev is None:
            raise RuntimeError("placeholder token before any step sampled (async scheduling invariant broken)")
        return self.prev


def _is_arange(a: np.ndarray) -> bool:
    return bool(a[0] == 0 and a[-1] == len(a) - 1 and (len(a) < 3 or (np.diff(a) == 1).all()))


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def _logprobs_to_host(lp: LogprobsTensors) -> LogprobsTensors:
    return dataclasses.replace(lp, logprobs=_pinned_copy(lp.logprobs), ranks=_pinned_copy(lp.ranks),
                               top_ids=_pinned_copy(lp.top_ids), top_logprobs=_pinned_copy(lp.top_logprobs))
