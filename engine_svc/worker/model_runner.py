"""Runs one scheduled step on one device: diffs -> persistent batch -> model forward -> sampling.

The runner never sees a tokenizer or text. It trusts the scheduler's SchedulerOutput completely:
new requests arrive in full, cached ones as diffs, and finished/preempted ids are dropped before the
step is laid out. Only requests whose scheduled tokens reach the end of their known tokens sample.
"""

from __future__ import annotations

import numpy as np
import torch

from engine_svc.attention.backend import AttentionMetadata
from engine_svc.sample.logprobs import compute_prompt_logprobs
from engine_svc.sample.metadata import RequestSamplingState, build_sampling_metadata
from engine_svc.sample.sampler import Sampler
from engine_svc.sched.output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from engine_svc.worker.cuda_graphs import DecodeCudaGraphs
from engine_svc.worker.input_batch import InputBatch, StepInputs


class ModelRunner:
    def __init__(self, model: torch.nn.Module, *, device: torch.device, max_num_seqs: int,
                 max_model_len: int, block_size: int, vocab_size: int) -> None:
        self.model = model
        self.device = device
        self.vocab_size = vocab_size
        self.batch = InputBatch(max_num_seqs, max_model_len, block_size)
        self.sampler = Sampler()
        self.sampling_states: dict[str, RequestSamplingState] = {}
        self.num_prompt_tokens: dict[str, int] = {}
        self.prompt_logprobs_wanted: dict[str, int] = {}
        self.kv_caches: list[torch.Tensor] = []
        # Set by Worker.initialize_cache when decode steps may replay CUDA graphs (CUDA + triton only).
        self.cuda_graphs: DecodeCudaGraphs | None = None

    # ---- state updates -------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self._drop(req_id)
        for req_id in so.preempted_req_ids:
            self._drop(req_id)
        for new in so.scheduled_new_reqs:
            self._add(new)
        for diff in so.scheduled_cached_reqs:
            self.batch.apply_diff(diff.req_id, diff.new_token_ids, diff.new_block_ids,
                                  diff.num_computed_tokens)
            if diff.new_token_ids:
                self.sampling_states[diff.req_id].output_token_ids.extend(diff.new_token_ids)

    def _add(self, new: NewRequestData) -> None:
        if new.req_id in self.batch:  # resumed after preemption without an explicit drop
            self._drop(new.req_id)
        self.batch.add(new.req_id, new.token_ids, new.block_ids, new.num_computed_tokens)
        prompt = new.token_ids[: new.num_prompt_tokens]
        self.sampling_states[new.req_id] = RequestSamplingState(
            new.sampling_params, prompt, new.eos_token_ids, self.vocab_size,
            output_token_ids=list(new.token_ids[new.num_prompt_tokens :]), device=self.device,
        )
        self.num_prompt_tokens[new.req_id] = new.num_prompt_tokens
        if new.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs_wanted[new.req_id] = new.sampling_params.prompt_logprobs

    def _drop(self, req_id: str) -> None:
        self.batch.remove(req_id)
        self.sampling_states.pop(req_id, None)
        self.num_prompt_tokens.pop(req_id, None)
        self.prompt_logprobs_wanted.pop(req_id, None)

    # ---- the step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        inputs = self.batch.prepare(so.num_scheduled_tokens)
        hidden = self._forward(inputs)
        sample_idx = np.flatnonzero(inputs.sample_mask)
        sampled = [-1] * len(inputs.req_ids)
        logprobs = None
        if len(sample_idx):
            last_token = inputs.query_start_loc[1:][sample_idx] - 1
            logits = self.model.compute_logits(hidden[torch.from_numpy(last_token).to(self.device)])
            states = [self.sampling_states[inputs.req_ids[i]] for i in sample_idx]
            out = self.sampler(logits, build_sampling_metadata(states, self.device))
            tokens = out.sampled_token_ids.tolist()
            for j, i in enumerate(sample_idx):
                sampled[i] = tokens[j]
            logprobs = self._scatter_logprobs(out, sample_idx, len(inputs.req_ids))
        return ModelRunnerOutput(
            req_ids=inputs.req_ids,
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs=self._prompt_logprobs(inputs, hidden) if self.prompt_logprobs_wanted else {},
        )

    # -- CUDA graphs hook (engine_svc/worker/cuda_graphs.py) --
    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states [T, hidden]: a CUDA graph replay for a decode-only step that fits a captured
        size, else the eager model call."""
        if self.cuda_graphs is not None:
            size = self.cuda_graphs.size_for(inputs)
            if size is not None:
                return self.cuda_graphs.replay(inputs, size)
        return self.model(
            torch.from_numpy(inputs.input_ids).to(self.device, non_blocking=True),
            torch.from_numpy(inputs.positions).to(self.device, non_blocking=True),
            self.kv_caches,
            self._attention_metadata(inputs),
        )

    def _attention_metadata(self, inputs: StepInputs) -> AttentionMetadata:
        dev = self.device
        return AttentionMetadata(
            slot_mapping=torch.from_numpy(inputs.slot_mapping).to(dev),
            query_start_loc=torch.from_numpy(inputs.query_start_loc.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(inputs.seq_lens.astype(np.int32)).to(dev),
            block_table=torch.from_numpy(np.ascontiguousarray(inputs.block_table)).to(dev),
            max_query_len=int(inputs.query_lens.max()),
            max_seq_len=int(inputs.seq_lens.max()),
            query_lens_cpu=inputs.query_lens.tolist(),
            seq_lens_cpu=inputs.seq_lens.tolist(),
            num_decodes=inputs.num_decodes,
        )

    @staticmethod
    def _scatter_logprobs(out: object, sample_idx: np.ndarray, batch_size: int) -> list | None:
        rows = out.logprobs_lists()  # type: ignore[attr-defined]
        if rows is None:
            return None
        full: list = [None] * batch_size
        for j, i in enumerate(sample_idx):
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
            result[req_id] = compute_prompt_logprobs(self.model.compute_logits(h), targets.to(h.device),
                                                     num_top)
        return result

    @torch.inference_mode()
    def profile_run(self, num_tokens: int) -> None:
        """A max-size prefill with a throwaway cache, so peak activation memory can be measured."""
        bs = self.batch.block_size
        num_blocks = -(-num_tokens // bs)
        m = self.model
        dtype = next(m.parameters()).dtype
        caches = [torch.zeros((2, num_blocks, bs, m.num_kv_heads, m.head_dim), dtype=dtype, device=self.device)
                  for _ in range(m.num_layers)]
        positions = torch.arange(num_tokens, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=positions.clone(),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            block_table=torch.arange(num_blocks, dtype=torch.int32, device=self.device)[None],
            max_query_len=num_tokens, max_seq_len=num_tokens,
            query_lens_cpu=[num_tokens], seq_lens_cpu=[num_tokens], num_decodes=0,
        )
        hidden = m(torch.zeros(num_tokens, dtype=torch.long, device=self.device), positions, caches, meta)
        m.compute_logits(hidden[: self.batch.token_ids.shape[0]])
        del caches, hidden
