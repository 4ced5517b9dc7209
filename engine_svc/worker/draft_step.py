"""The worker's draft model (`--speculative-config {"method": "draft_model", ...}`): drafts made in the step.

The scheduler reserves k draft places for each request that speculates (engine_svc/spec/proposers.py) and
allocates their KV slots. At the start of that step, before the target's forward, `DraftRunner.run`:

1. runs the draft model once over, for every scheduled request, the known tokens it has not seen yet
   and this step computes or has computed (prompt chunks, the last known token, accepted drafts the
   draft never fed itself): positions `seen .. known_end` where `known_end` is where the request's known
   tokens computed by this step end. For a request that verifies, the last of them gives draft 1;
2. runs k - 1 more single-token passes over the drafts just made, each giving the next draft;
3. writes the drafts into the runner's copy of the step's draft places and the persistent batch (the
   target then verifies them in the same step) and keeps each draft's distribution q for verification.

The draft's KV cache: one cache tensor per draft layer with the target's block count, addressed through
the target's block tables and slots (the scheduler's block ids name a block of both caches); with hybrid
KV groups (engine_svc/kv/groups.py), through group 0's, a full-attention group that keeps every block. The draft
writes K/V exactly where the target does, for the same tokens, so a block holds draft K/V wherever it
holds target K/V: a prefix-cache hit, a preempted request's recomputation and a freed block's reuse keep
both in step. Invariant per live request: the draft's K/V is valid for positions `< seen`, where
`seen = min(written, num_computed)`: `written` is the end of what the draft last wrote (its proposals
included) and the scheduler's `num_computed_tokens` ends before the first rejected draft. Rejected
drafts' positions are recomputed, then overwritten, in later steps.

Sampling: a greedy request's draft is the argmax of the draft's processed logits (q one-hot); a random
request's draft is drawn from q, the draft's distribution under the request's own sampling settings
(temperature, top-k/p, min-p, logit bias, allowed ids), which the rejection sampler then corrects to
the target's exactly (engine_svc/spec/rejection.py). With TP every rank feeds rank 0's drafts.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from engine_svc.attention.backend import AttentionMetadata
from engine_svc.distributed.parallel_state import get_tp_size, tensor_model_parallel_broadcast
from engine_svc.sample.metadata import RequestSamplingState, build_sampling_metadata
from engine_svc.sample.sampler import processed_logits
from engine_svc.sched.output import SchedulerOutput
from engine_svc.spec.rejection import sample_rows, target_probs
from engine_svc.worker.input_batch import InputBatch, StepInputs


class DraftRunner:
    """The draft model, its KV caches and what it has seen of each live request (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model: Any = model  # a causal LM of engine_svc/model (forward, compute_logits, num_layers, ...)
        self.device = device
        self.kv_caches: list[torch.Tensor] = []  # one per draft layer, set by Worker.initialize_cache
        self.written: dict[str, int] = {}  # request -> end of the positions the draft last wrote
        self.probs: dict[str, torch.Tensor] = {}  # verifying request -> q of its drafts [k, vocab]; random only

    def add(self, req_id: str, num_computed: int) -> None:
        """A request (re)joins the batch with `num_computed` tokens cached: prefix-cache hits hold draft
        K/V too (written beside the target's), so the draft has seen them."""
        self.written[req_id] = num_computed

    def drop(self, req_id: str) -> None:
        self.written.pop(req_id, None)
        self.probs.pop(req_id, None)

    def run(self, so: SchedulerOutput, batch: InputBatch, states: dict[str, RequestSamplingState],
            drafts_of: dict[str, list[int]]) -> None:
        """The draft's passes of step `so` (see the module docstring); fills `drafts_of`, the runner's
        copy of the step's draft places (`so` itself stays as the scheduler sent it)."""
        self.probs.clear()
        req_ids = list(so.num_scheduled_tokens)
        rows = np.fromiter((batch.row_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        computed = batch.num_computed[rows]
        num_drafts = np.fromiter((len(drafts_of.get(r, ())) for r in req_ids), dtype=np.int64, count=len(req_ids))
        known_end = computed + np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64,
                                           count=len(req_ids)) - num_drafts
        written = self.written
        starts = np.minimum(np.fromiter((written[r] for r in req_ids), dtype=np.int64, count=len(req_ids)),
                            computed)
        verifying = [i for i in range(len(req_ids)) if num_drafts[i]]
        hidden = self._forward(batch, rows, starts, known_end - starts, last_of=verifying)
        for i, r in enumerate(req_ids):
            written[r] = int(known_end[i])
        if not verifying:
            return
        ver_ids = [req_ids[i] for i in verifying]
        ver_rows, ends, ks = rows[verifying], known_end[verifying], num_drafts[verifying]
        made = MadeDrafts(len(verifying))
        live = list(range(len(verifying)))  # requests still drafting, as indices into ver_*
        for j in range(int(ks.max())):
            if j:  # the previous draft, at its own position, gives the next
                live = [v for v in live if ks[v] > j]
                pos = ends[live] + (j - 1)
                hidden = self._forward(batch, ver_rows[live], pos, np.ones(len(live), dtype=np.int64),
                                       last_of=list(range(len(live))))
            tokens, q = self._sample(hidden, [states[ver_ids[v]] for v in live])
            batch.token_ids[ver_rows[live], ends[live] + j] = tokens
            made.add(live, tokens, q)
        made.hand_over(ver_ids, drafts_of, self.probs)
        for v, r in enumerate(ver_ids):
            written[r] = int(ends[v] + ks[v] - 1)

    def draft_probs(self, req_ids: list[str], drafts: list[list[int]]) -> torch.Tensor | None:
        """q aligned with the verification's logits rows (each request's k draft rows, then a zero row
        for its bonus position); None when no verifying request drew its drafts at random."""
        if not any(r in self.probs for r in req_ids):
            return None
        vocab = next(iter(self.probs.values())).shape[1]
        parts: list[torch.Tensor] = []
        for r, d in zip(req_ids, drafts):
            q = self.probs.get(r)
            if q is None:  # greedy: one-hot at each draft
                q = torch.zeros((len(d), vocab), device=self.device).scatter_(
                    1, torch.tensor(d, device=self.device).unsqueeze(1), 1.0)
            parts.extend((q[: len(d)], torch.zeros((1, vocab), device=self.device)))
        return torch.cat(parts)

    def _sample(self, hidden: torch.Tensor, states: list[RequestSamplingState]
                ) -> tuple[np.ndarray, torch.Tensor | None]:
        """One draft per row and, when any row samples at random, q per row (greedy rows one-hot)."""
        logits = self.model.compute_logits(hidden)
        meta = build_sampling_metadata(states, self.device)
        processed = logits if meta.is_plain_greedy else processed_logits(logits, meta)
        argmax = processed.argmax(dim=-1)
        if meta.all_greedy:
            tokens, q = argmax, None
        else:
            q = target_probs(processed, argmax, meta)
            tokens = sample_rows(q, fallback=argmax)
        if get_tp_size() > 1:
            tensor_model_parallel_broadcast(tokens)  # every rank feeds the same drafts to the target
        return tokens.cpu().numpy(), q

    def _forward(self, batch: InputBatch, rows: np.ndarray, starts: np.ndarray, lens: np.ndarray,
                 last_of: list[int]) -> torch.Tensor:
        """The draft over tokens `starts[i] .. starts[i] + lens[i]` of each request (its K/V written into
        the draft's caches through the request's block table); the hidden states of the last token of
        the requests `last_of` (indices into `rows`), in that order."""
        step = PagedPass(batch, rows, starts, lens, self.device)
        ids = step.up(batch.token_ids[step.token_rows, step.positions], torch.int64)
        hidden: torch.Tensor = self.model(ids, step.up(step.positions, torch.int64), self.kv_caches, step.meta)
        return hidden.index_select(0, step.last_rows(last_of))

    def target_ran(self, inputs: StepInputs) -> None:
        """After the target's forward of a step: a draft model needs nothing from it."""


class MadeDrafts:
    """The drafts of the verifying requests (indices 0..n-1) as the passes make them, and for the random
    ones the q of each draft."""

    def __init__(self, n: int) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.q: list[list[torch.Tensor]] = [[] for _ in range(n)]

    def add(self, live: list[int], tokens: np.ndarray, q: torch.Tensor | None) -> None:
        """One pass's drafts: row n is request live[n]'s next draft (q None: every row greedy)."""
        for n, v in enumerate(live):
            self.tokens[v].append(int(tokens[n]))
            if q is not None:
                self.q[v].append(q[n])

    def hand_over(self, req_ids: list[str], drafts_of: dict[str, list[int]], probs: dict[str, torch.Tensor]) -> None:
        """Into the step's draft places, and each random request's q [k, vocab] for verification."""
        for v, r in enumerate(req_ids):
            drafts_of[r] = self.tokens[v]
            if self.q[v]:
                probs[r] = torch.stack(self.q[v])


class PagedPass:
    """One pass of a draft over tokens `starts[i] .. starts[i] + lens[i]` of the requests in `rows`:
    the requests reordered single-token first (the attention contract), each token's batch row and
    position (`token_rows`, `positions`, in that order) and the attention metadata over the caches
    addressed by the requests' block tables."""

    def __init__(self, batch: InputBatch, rows: np.ndarray, starts: np.ndarray, lens: np.ndarray,
                 device: torch.device) -> None:
        self.device = device
        self.order = order = np.argsort(lens != 1, kind="stable")
        rows, starts, lens = rows[order], starts[order], lens[order]
        self.inverse = np.empty_like(order)
        self.inverse[order] = np.arange(len(order))
        self.qsl = qsl = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lens, out=qsl[1:])
        total = int(qsl[-1])
        self.positions = np.arange(total, dtype=np.int64) - np.repeat(qsl[:-1] - starts, lens)
        self.token_rows = np.repeat(rows, lens)
        bs, groups = batch.block_size, batch.num_groups
        seq_lens = starts + lens
        # With hybrid KV groups the draft addresses group 0's table (a full group: every block is kept),
        # entries 0, G, 2G, ... of the interleaved row
        slots = (batch.block_table[self.token_rows, self.positions // bs * groups].astype(np.int64) * bs
                 + self.positions % bs)
        max_blocks = int(-(-seq_lens.max() // bs))
        up = self.up
        self.meta = AttentionMetadata(
            slot_mapping=up(slots, torch.int64), query_start_loc=up(qsl, torch.int32),
            seq_lens=up(seq_lens, torch.int32), block_table=up(batch.block_table[rows, : max_blocks * groups : groups], torch.int32),
            max_query_len=int(lens.max()), max_seq_len=int(seq_lens.max()), query_lens_cpu=lens.tolist(),
            seq_lens_cpu=seq_lens.tolist(), num_decodes=int((lens == 1).sum()),
        )

    def up(self, a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=self.device, dtype=dtype)

    def last_rows(self, last_of: list[int]) -> torch.Tensor:
        """Device indices of the last token of requests `last_of` (indices into the caller's `rows`)."""
        return self.up(self.qsl[1:][self.inverse[last_of]] - 1, torch.int64)
