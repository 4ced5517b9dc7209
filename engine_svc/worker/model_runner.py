"""Runs one scheduled step on one device: diffs -> persistent batch -> model forward -> sampling.

The runner never sees a tokenizer or text. It trusts the scheduler's SchedulerOutput completely:
new requests arrive in full, cached ones as diffs, and finished/preempted ids are dropped before the
step is laid out. Only requests whose scheduled tokens reach the end of their known tokens sample.

Host/device discipline (what keeps a GPU busy): a step reads nothing back from the device until the
sampled tokens, its one sync, at the very end. Everything goes up through one `StepStaging` (persistent
pinned buffers, async copies, one event): the inputs of eager steps and CUDA-graph replays alike, the
sampling parameters (per-row columns of the persistent batch, copied only when the batch changes:
sample/columns.py) and the per-step sampling arrays; so the forward, the logits and the sampler are
queued back to back while the host moves on.
Async scheduling (`async_scheduling=True`): a diff may append placeholders for the tokens this runner
sampled in its previous step; `PlaceholderFeed` (sampled_feed.py) writes those ids into the device
inputs, and `execute_model` returns a `PendingOutput` without reading the sampled ids back: the step has
no host sync at all, and the host reads them while the next step runs. With TP every rank then feeds
rank 0's ids (broadcast after sampling), as the scheduler's diffs do without async scheduling.
With speculative decoding as well, a placeholder standing for a run this runner verified is expanded on
the host, the row's `num_computed` corrected for the rejected places, and the drafts proposed here
(`AsyncSpeculation`, spec_async.py); such steps read the previous step's tokens on the host first.
Pipeline parallelism: a stage after the first receives the previous stage's hidden states and
residual instead of embedding the input ids; a stage before the last sends its output on and returns
an empty output (only the last stage samples, answers, and computes prompt logprobs). Every stage keeps
the same persistent batch, updated from the same diffs.
Positions never reach max_position (the rotary cache's rows): max_model_len is checked against it here,
and the persistent batch cannot hold a token past max_model_len.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from engine_svc.attention.backend import AttentionMetadata, with_kv_groups
from engine_svc.distributed.parallel_state import get_tp_size, stage_links, tensor_model_parallel_broadcast
from engine_svc.lora.manager import LoRAManager
from engine_svc.sample.columns import SamplingColumns
from engine_svc.sample.logprobs import compute_prompt_logprobs
from engine_svc.sample.metadata import (
    PLAIN_GREEDY,
    RequestSamplingState,
    SamplingMetadata,
    build_sampling_metadata,
)
from engine_svc.sample.sampler import Sampler
from engine_svc.sched.output import PLACEHOLDER_TOKEN, ModelRunnerOutput, NewRequestData, SchedulerOutput
from engine_svc.structured.bitmask import apply_bitmask
from engine_svc.worker.cuda_graphs import DecodeCudaGraphs
from engine_svc.worker.draft_step import DraftRunner
from engine_svc.worker.input_batch import InputBatch, StepInputs
from engine_svc.worker.sampled_feed import Fill, PendingOutput, PlaceholderFeed
from engine_svc.worker.spec_async import AsyncSpeculation
from engine_svc.worker.spec_step import put_drafts, verified_output
from engine_svc.worker.staging import StepStaging


def profile_seq_lens(num_tokens: int, max_model_len: int, max_num_seqs: int) -> list[int]:
    """Sequence lengths for a profile run: the largest step the scheduler can build.

    As many tokens as one step may hold (num_tokens, capped at max_num_seqs sequences of max_model_len),
    in sequences of at most max_model_len tokens, longest first (the worst case for attention too).
    """
    if num_tokens < 1 or max_model_len < 1 or max_num_seqs < 1:
        raise ValueError("profile_seq_lens needs positive sizes")
    total = min(num_tokens, max_model_len * max_num_seqs)
    full, rest = divmod(total, max_model_len)
    return [max_model_len] * full + ([rest] if rest else [])


class ModelRunner:
    def __init__(self, model: torch.nn.Module, *, device: torch.device, max_num_seqs: int,
                 max_model_len: int, block_size: int, vocab_size: int, max_num_batched_tokens: int,
                 async_scheduling: bool = False, kv_num_groups: int = 1) -> None:
        """`kv_num_groups`: the hybrid KV groups whose tables the scheduler sends interleaved (1: none)."""
        max_position = getattr(model, "max_position", None)
        if max_position is not None and max_model_len > max_position:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's {max_position} rotary positions "
                             "(max_position_embeddings); lower --max-model-len")
        self.model = model
        self.device = device
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len  # the configured value until set_max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = block_size
        self.async_scheduling = async_scheduling
        self.kv_num_groups = kv_num_groups
        self._size_for(max_model_len)
        self.sampler = Sampler()
        self.sampling_states: dict[str, RequestSamplingState] = {}
        self._plain = PlainRows()
        self.num_prompt_tokens: dict[str, int] = {}
        self.prompt_logprobs_wanted: dict[str, int] = {}
        self.kv_caches: list[torch.Tensor] = []  # one per layer of this pipeline stage
        self.stage = stage_links()  # the neighbouring pipeline stages (none with one stage)
        # Set by Worker.initialize_cache when decode steps may replay CUDA graphs (CUDA + triton only).
        self.cuda_graphs: DecodeCudaGraphs | None = None
        # Multi-LoRA (set by Worker.load_model with --enable-lora): the adapter slots, and each row's adapter.
        self.lora: LoRAManager | None = None
        self.row_lora = np.zeros(max_num_seqs, dtype=np.int64)
        # Speculative decoding with a draft model (set by Worker.load_model): drafts made in the step.
        self.drafter: DraftRunner | None = None
        self.pulled_blocks: set[int] = set()  # blocks this step's P/D loads wrote (the target's K/V only)
        # Speculative decoding under async scheduling (set by Worker.load_model): runs and drafts kept here.
        self.spec_async: AsyncSpeculation | None = None

    def set_max_model_len(self, max_model_len: int) -> None:
        """Size the persistent batch (and what CUDA graphs read) for the max_model_len the engine serves,
        which it may have lowered below the configured one to what the KV cache holds. Before any step.
        The profile run, which sizes the cache, uses the configured value."""
        if len(self.batch.row_of):
            raise RuntimeError("set_max_model_len must run before the first step")
        if not 1 <= max_model_len <= self.max_model_len:
            raise ValueError(f"served max_model_len {max_model_len} must be in [1, {self.max_model_len}]")
        self._size_for(max_model_len)

    def _size_for(self, max_model_len: int) -> None:
        """The persistent batch, the staging buffers and the sampling columns, for `max_model_len`."""
        self.max_model_len = max_model_len
        self.batch = InputBatch(self.max_num_seqs, max_model_len, self.block_size, self.kv_num_groups)
        self.staging = StepStaging(
            self.device, max_tokens=max(self.max_num_batched_tokens, self.max_num_seqs), max_reqs=self.max_num_seqs,
            max_blocks_per_req=self.batch.block_table.shape[1], double_buffered=self.async_scheduling,
            num_groups=self.kv_num_groups,
        )
        self.sampling_columns = SamplingColumns(self.max_num_seqs, self.staging)
        self.feed = PlaceholderFeed(self.max_num_seqs) if self.async_scheduling else None

    # ---- state updates -------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self._drop(req_id)
        for req_id in so.preempted_req_ids:
            self._drop(req_id)
        for new in so.scheduled_new_reqs:
            self._add(new)
        states = self.sampling_states
        for diff in so.scheduled_cached_reqs:
            tokens = diff.new_token_ids
            self.batch.apply_diff(diff.req_id, tokens, diff.new_block_ids, diff.num_computed_tokens)
            if tokens and tokens[-1] == PLACEHOLDER_TOKEN:  # async scheduling: the tail is this runner's sample
                tokens = self._note_placeholder(diff.req_id, tokens)
            if tokens:
                states[diff.req_id].output_token_ids.extend(tokens)
        self._apply_decodes(so.decode_req_ids, so.decode_token_ids, so.decode_num_computed_tokens)

    def _note_placeholder(self, req_id: str, tokens: list[int]) -> list[int]:
        """Tell the feed where a diff's placeholder went (only ever its last token); the tokens before it.
        A placeholder for a run this runner verified becomes that run at once (spec_async.py); the tokens
        before it and the run are returned then."""
        if self.feed is None or tokens.count(PLACEHOLDER_TOKEN) != 1:
            raise RuntimeError(f"request {req_id!r}: unexpected placeholder tokens {tokens} "
                               f"(async scheduling {'on' if self.feed else 'off'} in this worker)")
        if self.spec_async is not None:
            run = self.spec_async.expand(self.batch, req_id)
            if run is not None:
                return tokens[:-1] + run
        row = self.batch.row_of[req_id]
        self.feed.note(req_id, row, int(self.batch.num_tokens[row]) - 1)
        return tokens[:-1]

    def _apply_decodes(self, req_ids: list[str], tokens: list[int], num_computed: list[int]) -> None:
        """The step's steady decodes (the scheduler's columns: one token each, no block): one vectorised
        write into the persistent batch, and each token appended to its request's sampling state."""
        if not req_ids:
            return
        self.batch.apply_decode_diffs(req_ids, tokens, num_computed)
        states = self.sampling_states
        if self.feed is not None and PLACEHOLDER_TOKEN in tokens:  # async scheduling
            rows, feed, num_tokens = self.batch.row_of, self.feed, self.batch.num_tokens
            spec = self.spec_async
            for req_id, token in zip(req_ids, tokens):
                if token == PLACEHOLDER_TOKEN:
                    run = spec.expand(self.batch, req_id) if spec is not None else None
                    if run is not None:  # it verified drafts in this runner's last step
                        states[req_id].output_token_ids.extend(run)
                        continue
                    row = rows[req_id]
                    feed.note(req_id, row, int(num_tokens[row]) - 1)
                else:
                    states[req_id].output_token_ids.append(token)
            return
        for req_id, token in zip(req_ids, tokens):
            states[req_id].output_token_ids.append(token)

    def _add(self, new: NewRequestData) -> None:
        if new.req_id in self.batch:  # resumed after preemption without an explicit drop
            self._drop(new.req_id)
        row = self.batch.add(new.req_id, new.token_ids, new.block_ids, new.num_computed_tokens)
        self.row_lora[row] = new.lora_id
        prompt = new.token_ids[: new.num_prompt_tokens]
        state = self.sampling_states[new.req_id] = RequestSamplingState(
            new.sampling_params, prompt, new.eos_token_ids, self.vocab_size,
            output_token_ids=list(new.token_ids[new.num_prompt_tokens :]), device=self.device,
        )
        self.sampling_columns.set_row(row, state)
        self._plain.add(new.req_id, state)
        self.num_prompt_tokens[new.req_id] = new.num_prompt_tokens
        if new.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs_wanted[new.req_id] = new.sampling_params.prompt_logprobs
        if self.drafter is not None:
            self.drafter.add(new.req_id, self._draft_cached(new))

    def _draft_cached(self, new: NewRequestData) -> int:
        """How many of a joining request's cached tokens have the draft's K/V too: a local prefix hit's
        blocks hold it (written beside the target's), blocks pulled from another engine this step do not
        (P/D moves the target's K/V), so the draft catches up from the first pulled block on."""
        if self.pulled_blocks:
            bs = self.batch.block_size
            for i, block in enumerate(new.block_ids[: -(-new.num_computed_tokens // bs)]):
                if block in self.pulled_blocks:
                    return i * bs
        return new.num_computed_tokens

    def _drop(self, req_id: str) -> None:
        self.batch.remove(req_id)
        state = self.sampling_states.pop(req_id, None)
        if state is not None:
            self._plain.drop(req_id, state)
        self.num_prompt_tokens.pop(req_id, None)
        self.prompt_logprobs_wanted.pop(req_id, None)
        if self.drafter is not None:
            self.drafter.drop(req_id)

    # ---- the step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | PendingOutput:
        """Run one step. Returns its output, or under async scheduling a `PendingOutput` (no host sync)."""
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        places = so.scheduled_spec_decode_tokens
        drafts = {r: list(d) for r, d in places.items()} if places else places  # ours: the scheduler's stay
        num_scheduled = so.num_scheduled_tokens
        if self.feed is not None and self.feed.num_noted and (places or self.drafter is not None):
            self.feed.resolve(self.batch, self.sampling_states)  # drafts are made from the tokens on the host
        if self.drafter is not None:
            self.drafter.run(so, self.batch, self.sampling_states, drafts)  # fills the step's draft places
        elif places and self.spec_async is not None and self.spec_async.proposer is not None:
            drafts = self.spec_async.propose(self.batch, places)
            num_scheduled = _fewer_drafts(num_scheduled, places, drafts)
        if drafts:
            put_drafts(self.batch, drafts)
        inputs = self.batch.prepare(num_scheduled)
        sample_idx = np.flatnonzero(inputs.sample_mask)
        last_token = inputs.query_start_loc[1:][sample_idx] - 1  # the hidden row each sampling request reads
        self.staging.begin_step()
        feed = self.feed
        fill = feed.fill_for(inputs, self.staging) if feed is not None else None
        hidden, sample_rows = self._forward(inputs, last_token, fill)
        if self.drafter is not None:
            self.drafter.target_ran(inputs)  # an EAGLE-3 head keeps the target's features
        if hidden is None:  # a pipeline stage before the last: its output went to the next stage
            self.staging.end_step()
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        if feed is not None:
            feed.resolve(self.batch, self.sampling_states)  # the previous step's ids, before sampling reads them
        req_ids = inputs.req_ids
        prompt_logprobs = self._prompt_logprobs(inputs, hidden) if self.prompt_logprobs_wanted else {}
        if not len(sample_idx):
            self.staging.end_step()
            if feed is not None:
                feed.record(torch.empty(0, dtype=torch.int64, device=self.device), sample_idx, None)
                if self.spec_async is not None:
                    self.spec_async.clear()
            return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[-1] * len(req_ids),
                                     prompt_logprobs=prompt_logprobs)
        if places:  # speculative decoding: verify the drafts (spec_step.py)
            verified = verified_output(self, so, drafts, inputs, sample_idx, hidden, prompt_logprobs)
            if feed is not None:  # async scheduling: the next step's placeholders stand for these tokens
                feed.record(torch.tensor([verified.sampled_token_ids[i] for i in sample_idx.tolist()],
                                         dtype=torch.int64, device=self.device), inputs.rows[sample_idx], None)
                if self.spec_async is not None:
                    self.spec_async.record(verified.spec_token_ids, places)
            return verified
        if self.spec_async is not None:
            self.spec_async.clear()
        # Python ints, not numpy scalars, index the per-request lists and dicts below; when every row
        # samples (a decode step), the sampling rows are the batch order itself.
        every_row = len(sample_idx) == len(req_ids)
        sample_ids = req_ids if every_row else [req_ids[i] for i in sample_idx.tolist()]
        batch_rows = inputs.rows if every_row else inputs.rows[sample_idx]
        meta = self._sampling_metadata(sample_ids, batch_rows)
        self.staging.end_step()
        rows = hidden[: len(sample_idx)] if sample_rows is None else hidden.index_select(0, sample_rows)
        logits = self.model.compute_logits(rows)
        if so.grammar is not None:  # structured outputs: mask the constrained rows before sampling
            apply_bitmask(logits, so.grammar, {r: j for j, r in enumerate(sample_ids)})
        out = self.sampler(logits, meta)
        if feed is not None:
            tokens = out.sampled_token_ids
            if get_tp_size() > 1:
                tensor_model_parallel_broadcast(tokens)  # every rank feeds rank 0's ids
            step = feed.record(tokens, batch_rows, out.logprobs)
            return PendingOutput(req_ids, None if every_row else sample_idx, step, prompt_logprobs)
        tokens_list = out.sampled_token_ids.tolist()  # the step's one device -> host sync
        if every_row:
            sampled = tokens_list
        else:
            sampled = [-1] * len(req_ids)
            for j, i in enumerate(sample_idx.tolist()):
                sampled[i] = tokens_list[j]
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=sampled,
            logprobs=self._scatter_logprobs(out, sample_idx, len(req_ids)),
            prompt_logprobs=prompt_logprobs,
        )

    def _sampling_metadata(self, sample_ids: list[str], batch_rows: np.ndarray) -> SamplingMetadata:
        """`build_sampling_metadata` of the sampling rows; when every live request is plain greedy by now
        (`PlainRows`), the shared plain-greedy metadata without a look at any row."""
        if self._plain.all_plain():
            return PLAIN_GREEDY
        states_of = self.sampling_states
        return build_sampling_metadata(
            [states_of[r] for r in sample_ids], self.device, columns=self.sampling_columns, rows=batch_rows,
            stage=self.staging.stage_arrays, present=self._plain.features,
        )

    # -- CUDA graphs hook (engine_svc/worker/cuda_graphs.py) --
    def _forward(self, inputs: StepInputs, last_token: np.ndarray,
                 fill: Fill | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(hidden states [T, hidden], device indices of the rows to sample, or None when they are the
        first len(last_token) rows): a CUDA graph replay for a decode-only step that fits a captured
        size, else the eager model call. `fill` rewrites the staged input ids (async scheduling).
        A pipeline stage before the last sends its output to the next stage and returns no hidden states."""
        # Every request decodes one token and samples (the steady step): the rows are 0..n-1 by construction.
        first_rows = (inputs.num_decodes == len(last_token) == len(inputs.req_ids)
                      or bool(np.array_equal(last_token, np.arange(len(last_token)))))
        rows = None if first_rows else self.staging.stage_sample_rows(last_token)
        if self.lora is not None:  # this step's adapters into device slots, and each token's slot (graphs too)
            self.lora.prepare(np.repeat(self.row_lora[inputs.rows], inputs.query_lens))
        if self.cuda_graphs is not None:
            size = self.cuda_graphs.size_for(inputs)
            if size is not None:
                return self.cuda_graphs.replay(inputs, size, fill), rows
        staged = self.staging.stage_inputs(inputs, fill=fill)
        meta = AttentionMetadata(
            slot_mapping=staged.slot_mapping,
            query_start_loc=staged.query_start_loc,
            seq_lens=staged.seq_lens,
            block_table=staged.block_table,
            max_query_len=int(inputs.query_lens.max()),
            max_seq_len=int(inputs.seq_lens.max()),
            query_lens_cpu=inputs.query_lens.tolist(),
            seq_lens_cpu=inputs.seq_lens.tolist(),
            num_decodes=inputs.num_decodes,
        )
        if staged.group_slots is not None:
            with_kv_groups(meta, staged.group_slots, self.kv_num_groups)
        stage, model = self.stage, self.model
        if stage.prev_rank is None:
            out = model(staged.input_ids, staged.positions, self.kv_caches, meta)
        else:
            intermediate = stage.recv(staged.input_ids.shape[0], model.hidden_size, model.dtype, self.device)
            out = model(staged.input_ids, staged.positions, self.kv_caches, meta, intermediate)
        if stage.next_rank is not None:
            stage.send(*out)
            return None, rows
        return out, rows

    @staticmethod
    def _scatter_logprobs(out: object, sample_idx: np.ndarray, batch_size: int) -> list | None:
        rows = out.logprobs_lists()  # type: ignore[attr-defined]
        if rows is None:
            return None
        if len(rows) == batch_size:  # every row sampled, in batch order
            return rows
        full: list = [None] * batch_size
        for j, i in enumerate(sample_idx.tolist()):
            full[i] = rows[j]
        return full

    def _prompt_logprobs(self, inputs: StepInputs, hidden: torch.Tensor) -> dict[str, list]:
        """Logprobs of prompt tokens 1..P-1 covered by this step's chunk of each request asking for them."""
        result: dict[str, list] = {}
        for i, req_id in enumerate(inputs.req_ids):
            num_top = self.prompt_logprobs_wanted.get(req_id)
            if num_top is None:
                continue
            start_pos = int(inputs.seq_lens[i] - inputs.query_lens[i])
            num_prompt = self.num_prompt_tokens[req_id]
            # Position p predicts token p + 1; only predictions of prompt tokens count.
            end_pos = min(int(inputs.seq_lens[i]), num_prompt - 1)
            if end_pos <= start_pos:
                continue
            q0 = int(inputs.query_start_loc[i])
            h = hidden[q0 : q0 + (end_pos - start_pos)]
            row = self.batch.row_of[req_id]
            targets = torch.from_numpy(self.batch.token_ids[row, start_pos + 1 : end_pos + 1].copy())
            result[req_id] = compute_prompt_logprobs(h, targets.to(h.device), num_top, self.model.compute_logits)
        return result

    @torch.inference_mode()
    def profile_run(self, num_tokens: int) -> int:
        """The largest step the scheduler can build, run once so that peak memory can be measured.

        A prefill of `profile_seq_lens(num_tokens, max_model_len, max_num_seqs)` (never a position at or
        past max_model_len), then logits and random top-k/top-p sampling for max_num_seqs rows (the
        sampler's sort is its largest temporary), over a throwaway KV cache that all sequences share
        (only shapes matter). Returns the throwaway cache's bytes: the caller subtracts them from the
        peak, since the real cache is sized from what is left.
        """
        lens = profile_seq_lens(num_tokens, self.max_model_len, self.max_num_seqs)
        m, dev, bs = self.model, self.device, self.batch.block_size
        blocks = -(-lens[0] // bs)
        dtype = next(m.parameters()).dtype
        caches = [torch.zeros(m.attn_backend.kv_cache_shape(blocks, bs, m.num_kv_heads, m.head_dim), dtype=dtype,
                              device=dev)
                  for _ in range(m.num_layers)]
        positions = np.concatenate([np.arange(n) for n in lens])  # every sequence in blocks 0..blocks-1
        qsl = np.concatenate([[0], np.cumsum(lens)])
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(positions).to(dev),
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_table=torch.arange(blocks, dtype=torch.int32, device=dev).repeat(len(lens), 1),
            max_query_len=lens[0], max_seq_len=lens[0], query_lens_cpu=lens, seq_lens_cpu=lens, num_decodes=0,
        )
        total = int(qsl[-1])
        ids, pos = torch.zeros(total, dtype=torch.long, device=dev), torch.from_numpy(positions).to(dev)
        if getattr(m, "is_first_stage", True):
            hidden = m(ids, pos, caches, meta)
        else:  # a later pipeline stage: stand-in activations of the previous stage's shape
            zeros = torch.zeros((total, m.hidden_size), dtype=dtype, device=dev)
            hidden = m(ids, pos, caches, meta, (zeros, zeros.clone()))
        cache_bytes = sum(c.numel() * c.element_size() for c in caches)
        if getattr(m, "is_last_stage", True):
            rows = torch.arange(self.max_num_seqs, device=dev) % total
            logits = m.compute_logits(hidden.index_select(0, rows))
            self.sampler(logits, _profile_sampling_metadata(self.max_num_seqs, dev))
            del logits
        del caches, hidden
        return cache_bytes


def _fewer_drafts(num_scheduled: dict[str, int], places: dict[str, list[int]],
                  drafts: dict[str, list[int]]) -> dict[str, int]:
    """The step's tokens per request when some requests got fewer drafts than places (prompt lookup
    under async scheduling): each runs 1 + its drafts after its known tokens. `num_scheduled` itself
    when none did (it is the scheduler's: never changed)."""
    short = {r: len(p) - len(drafts[r]) for r, p in places.items() if len(drafts[r]) < len(p)}
    if not short:
        return num_scheduled
    return {r: n - short.get(r, 0) for r, n in num_scheduled.items()}


class PlainRows:
    """Which live requests of the worker may still need more than a plain argmax, and which of the
    optional sampling features (metadata.FEATURES) any live request uses.

    A request's state is plain once `len(output_token_ids) >= plain_after`; outputs only grow, so once
    plain it stays plain. `all_plain` is therefore exact: True iff every live request is plain now.
    Requests that can never be plain (`plain_after` infinite) are only counted, never re-checked, so a
    step of random sampling pays nothing here per request.
    """

    def __init__(self) -> None:
        self._never = 0  # live requests that are never plain
        self._later: dict[str, RequestSamplingState] = {}  # live, plain only after more outputs
        self._counts: dict[str, int] = {}  # feature -> live requests using it
        self.features: set[str] = set()  # the features with a positive count

    def add(self, req_id: str, state: RequestSamplingState) -> None:
        if state.plain_after == math.inf:
            self._never += 1
        elif len(state.output_token_ids) < state.plain_after:
            self._later[req_id] = state
        for name in state.features:
            self._counts[name] = self._counts.get(name, 0) + 1
            self.features.add(name)

    def drop(self, req_id: str, state: RequestSamplingState) -> None:
        if state.plain_after == math.inf:
            self._never -= 1
        self._later.pop(req_id, None)
        for name in state.features:
            self._counts[name] -= 1
            if not self._counts[name]:
                self.features.discard(name)

    def all_plain(self) -> bool:
        """True when every live request is plain greedy now (forgetting those that became plain)."""
        if self._never:
            return False
        later = self._later
        if later:
            for req_id in [r for r, s in later.items() if len(s.output_token_ids) >= s.plain_after]:
                del later[req_id]
        return not later


def _profile_sampling_metadata(num_rows: int, device: torch.device) -> SamplingMetadata:
    """Random sampling with top-k and top-p on every row: the sampler's most memory-hungry path."""
    return SamplingMetadata(
        all_greedy=False,
        temperature=torch.full((num_rows,), 0.7, device=device),
        top_k=torch.full((num_rows,), 50, dtype=torch.int64, device=device),
        top_k_max=50,
        top_p=torch.full((num_rows,), 0.9, device=device),
    )
