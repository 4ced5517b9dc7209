"""Sampling parameters as per-row columns of the worker's persistent batch, copied only when the batch changes.

Each live request owns a row of the persistent batch (engine_svc/worker/input_batch.py); `set_row` writes its
temperature and filters into that row of host columns when it joins. A step samples some rows in some
order; `params_for(rows)` gathers those rows into the staging's buffer pairs and copies them up, and hands
the same device tensors back for every following step with the same rows in the same order and no row
rewritten since (a steady decode batch: nothing is copied). Any change, a request joining (which rewrites
a row) or leaving, or a different order, re-gathers and re-copies.

The values equal `metadata.step_sampling_params` of the same requests (tests/engine/test_staging.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from engine_svc.sample.metadata import RequestSamplingState, StepSamplingParams, effective_top_k

if TYPE_CHECKING:
    from engine_svc.worker.staging import StepStaging

_COLUMNS = (("temperature", torch.float32), ("greedy", torch.bool), ("top_k", torch.int64),
            ("top_p", torch.float32), ("min_p", torch.float32))


class SamplingColumns:
    """Host columns indexed by persistent-batch row, and the device copies of the last step's gather."""

    def __init__(self, max_reqs: int, staging: StepStaging) -> None:
        self.temperature = np.ones(max_reqs, dtype=np.float32)  # 1.0 on greedy rows, as the sampler wants
        self.greedy = np.ones(max_reqs, dtype=bool)
        self.top_k = np.zeros(max_reqs, dtype=np.int64)  # 0: off
        self.top_p = np.ones(max_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_reqs, dtype=np.float32)
        self._twins = {name: staging.twin((max_reqs,), dtype) for name, dtype in _COLUMNS}
        self._version = 0  # bumped by every row write
        self._key: tuple[bytes, int] | None = None
        self._params = StepSamplingParams(all_greedy=True)
        self.num_gathers = 0  # how many times params_for gathered and copied (tests)

    def set_row(self, row: int, state: RequestSamplingState) -> None:
        """Row `row` now holds `state`'s request."""
        p = state.params
        self.greedy[row] = state.is_greedy
        self.temperature[row] = 1.0 if state.is_greedy else p.temperature
        self.top_k[row] = effective_top_k(p.top_k, state.vocab_size)
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self._version += 1

    def params_for(self, rows: np.ndarray) -> StepSamplingParams:
        """The parameters of batch rows `rows` (in step order) on the device; reused while unchanged."""
        key = (rows.tobytes(), self._version)
        if key != self._key:
            self._params = self._gather(rows)
            self._key = key
            self.num_gathers += 1
        return self._params

    def _gather(self, rows: np.ndarray) -> StepSamplingParams:
        greedy = self.greedy[rows]
        out = StepSamplingParams(all_greedy=bool(greedy.all()))
        if out.all_greedy:
            return out
        out.temperature = self._upload("temperature", self.temperature[rows])
        if greedy.any():
            out.greedy_rows = self._upload("greedy", greedy)
        top_k = self.top_k[rows]
        if top_k.any():
            out.top_k, out.top_k_max = self._upload("top_k", top_k), int(top_k.max())
        top_p = self.top_p[rows]
        if (top_p < 1.0).any():
            out.top_p = self._upload("top_p", top_p)
        min_p = self.min_p[rows]
        if (min_p > 0.0).any():
            out.min_p = self._upload("min_p", min_p)
        return out

    def _upload(self, name: str, values: np.ndarray) -> torch.Tensor:
        twin = self._twins[name]
        twin.host[: len(values)] = values
        return twin.upload(len(values))
