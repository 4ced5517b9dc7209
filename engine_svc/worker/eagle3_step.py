"""The worker's EAGLE-3 head (`--speculative-config {"method": "eagle3", ...}`): drafts made in the step.

As for a draft model (draft_step.py), the scheduler reserves k draft places per verifying request and the
head fills them at the start of that step, before the target verifies them. What the head reads differs:
the target's auxiliary hidden states, which exist only for tokens the target has computed. So the head
runs one step behind the target:

- after each target forward, `target_ran` keeps, per request of the step, `fc(aux)` of every position
  the target computed (`pending`: rows for positions `start ..`; rejected drafts' rows are never read);
- at the start of the next step the request is scheduled in, `run` feeds the head the positions
  `seen .. computed` (computed: the target's `num_computed_tokens` now, after verification): the head's
  entry at position p pairs the token at p + 1 (known: a prompt token, an accepted draft or the token
  just sampled) with the target's features at p (vLLM's shifted input). For a verifying request the last
  of them (p = computed - 1) gives draft 1;
- drafts 2..k chain (vLLM's): the head's entry at position computed + j - 1 pairs draft j with the head's
  own pre-norm output at the position before, and gives draft j + 1.

The head's KV cache (one layer) uses the target's block ids, as a draft model's does. Invariant per live
request: the head's K/V is valid for positions `< seen`, `seen = min(written, num_computed)`, where
`written` is the `computed` of the head's last pass (its chained positions lie beyond it and are
overwritten by the next pass). A prefix-cache hit or a resumed request starts at `seen = num_computed`:
the cached blocks hold the head's K/V if the head ran over them before they were reused, except at the
last position of a request's last computed block (its entry needed the next token). Stale head K/V only
lowers acceptance: verification keeps the output exactly the target's whatever the head proposes. A
verifying request with nothing to feed (`seen == computed`: nothing computed since its head K/V was
resumed) proposes its last token k times, a draft like any other (q one-hot).

Sampling, q and TP as for a draft model (draft_step.py); the head's logits cover the target vocabulary
(draft ids mapped through d2t, the rest at zero probability).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from engine_svc.sample.metadata import RequestSamplingState
from engine_svc.sched.output import SchedulerOutput
from engine_svc.worker.draft_step import DraftRunner, MadeDrafts, PagedPass
from engine_svc.worker.input_batch import InputBatch, StepInputs


class Eagle3Runner(DraftRunner):
    """The head, its KV cache, what it has seen of each live request and the target features it has not
    read yet (see the module docstring)."""

    def __init__(self, head: torch.nn.Module, target: Any, device: torch.device) -> None:
        super().__init__(head, device)
        self.target_model: Any = target.model  # keeps `aux_hidden` after each forward
        self.pending: dict[str, tuple[torch.Tensor, int]] = {}  # request -> (fc(aux) rows, first position)

    def add(self, req_id: str, num_computed: int) -> None:
        super().add(req_id, num_computed)
        self.pending.pop(req_id, None)

    def drop(self, req_id: str) -> None:
        super().drop(req_id)
        self.pending.pop(req_id, None)

    def target_ran(self, inputs: StepInputs) -> None:
        """Keep fc(aux) of every position the target computed for each request of the step."""
        combined = self.model.combine(self.target_model.aux_hidden)
        qsl = inputs.query_start_loc
        starts = inputs.seq_lens - inputs.query_lens
        for i, req_id in enumerate(inputs.req_ids):
            self.pending[req_id] = (combined[int(qsl[i]):int(qsl[i + 1])], int(starts[i]))

    def run(self, so: SchedulerOutput, batch: InputBatch, states: dict[str, RequestSamplingState],
            drafts_of: dict[str, list[int]]) -> None:
        """The head's passes of step `so` (see the module docstring); fills `drafts_of`, the runner's
        copy of the step's draft places."""
        self.probs.clear()
        written, pending = self.written, self.pending
        req_ids = list(so.num_scheduled_tokens)
        rows = np.fromiter((batch.row_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        computed = batch.num_computed[rows]
        fed: list[int] = []  # indices into req_ids of the requests the first pass feeds, up to `computed`
        starts: list[int] = []
        inputs: list[torch.Tensor] = []
        for i, r in enumerate(req_ids):
            end, start = int(computed[i]), min(written[r], int(computed[i]))
            written[r] = end
            kept = pending.get(r)
            if kept is None:
                continue
            rows_kept, first = kept
            start = max(start, first)  # positions before `first` have no features: their K/V stays stale
            if start < end <= first + len(rows_kept):
                fed.append(i)
                starts.append(start)
                inputs.append(rows_kept[start - first:end - first])
        fed_at = {i: n for n, i in enumerate(fed)}
        drafting: list[int] = []
        for i, r in enumerate(req_ids):
            if drafts_of.get(r):
                if i in fed_at:
                    drafting.append(i)
                else:  # nothing to feed the head (see the module docstring)
                    drafts_of[r] = [int(batch.token_ids[rows[i], int(batch.num_tokens[rows[i]]) - 1])] * len(drafts_of[r])
        if not fed:
            return
        begin = np.array(starts, dtype=np.int64)
        normed, prenorm = self._pass(batch, rows[fed], begin, computed[fed] - begin, inputs,
                                     [fed_at[i] for i in drafting])
        if drafting:
            self._chain([req_ids[i] for i in drafting], rows[drafting], computed[drafting], drafts_of, states,
                        batch, normed, prenorm)

    def _chain(self, ver_ids: list[str], ver_rows: np.ndarray, ends: np.ndarray, drafts_of: dict[str, list[int]],
               states: dict[str, RequestSamplingState], batch: InputBatch, normed: torch.Tensor,
               prenorm: torch.Tensor) -> None:
        """Draft 1 from the first pass's `normed` rows of the verifying requests, then drafts 2..k, each
        from the head over the previous draft and the previous pre-norm output."""
        ks = np.fromiter((len(drafts_of[r]) for r in ver_ids), dtype=np.int64, count=len(ver_ids))
        made = MadeDrafts(len(ver_ids))
        live = list(range(len(ver_ids)))
        for j in range(int(ks.max())):
            if j:
                keep = [n for n, v in enumerate(live) if ks[v] > j]
                live = [live[n] for n in keep]
                step = PagedPass(batch, ver_rows[live], ends[live] + (j - 1), np.ones(len(live), dtype=np.int64),
                                 self.device)
                ids = step.up(np.array([made.tokens[v][-1] for v in live]), torch.int64)
                normed, prenorm = self.model(ids, step.up(step.positions, torch.int64), prenorm[keep],
                                             self.kv_caches, step.meta)
            tokens, q = self._sample(normed, [states[ver_ids[v]] for v in live])
            made.add(live, tokens, q)
        made.hand_over(ver_ids, drafts_of, self.probs)

    def _pass(self, batch: InputBatch, rows: np.ndarray, starts: np.ndarray, lens: np.ndarray,
              inputs: list[torch.Tensor], last_of: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over positions `starts[i] .. starts[i] + lens[i]` of each request, fed the token after
        each position and `inputs[i]` (its fc(aux) rows); (normed, prenorm) of the last position of the
        requests `last_of` (indices into `rows`), in that order."""
        step = PagedPass(batch, rows, starts, lens, self.device)
        ids = step.up(batch.token_ids[step.token_rows, step.positions + 1], torch.int64)
        hidden = torch.cat([inputs[i] for i in step.order.tolist()])
        normed, prenorm = self.model(ids, step.up(step.positions, torch.int64), hidden, self.kv_caches, step.meta)
        last = step.last_rows(last_of)
        return normed.index_select(0, last), prenorm.index_select(0, last)


def load_eagle3_runner(target_dir: str, head_dir: str | None, target: Any, dtype: torch.dtype, device: torch.device,
                       backend: Any) -> Eagle3Runner:
    """Load the head of --speculative-config (eagle3) beside `target`, same dtype, and make the target
    keep the auxiliary hidden states the head reads."""
    from engine_svc.model.eagle3 import load_eagle3_head
    from engine_svc.spec.eagle3_head import read_eagle3_head

    assert head_dir is not None
    info = read_eagle3_head(target_dir, head_dir)
    head = load_eagle3_head(head_dir, info, target, dtype, device, backend)
    target.model.aux_layer_ids = info.aux_layer_ids
    return Eagle3Runner(head, target, device)
