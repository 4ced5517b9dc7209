"""The scheduler's decode-step fast paths against the general path they shortcut, step by step.

Two schedulers get the same seeded workload: the real one, and a reference whose KV manager always takes
`_allocate` (the general allocation) and whose per-token update is the plain one the fast path replaced
(`_check_stop` on every token, hashing through `hash_blocks` on every token, the event lists swapped on
every output, prompt tokens counted from the requests at update time). Every SchedulerOutput, every
EngineCoreOutputs (event times aside), every block table and block hash list, and the free blocks must be
the same after each step. The workload has what the fast paths must not get wrong: steady all-decode steps,
steps where a request finishes (EOS, stop id, length, min_tokens holding a stop back, ignore_eos) or a new
one arrives or is aborted, preemptions, chunked prefill, prefix hits, and blocks filling on a decode.

The worker side too: the reference scheduler sends every cached request as a `CachedRequestData` (the
form before the columnar decodes), and two ModelRunners apply the two outputs step by step (the real one
through its columnar decode path and the row memo in `InputBatch.prepare`, the reference through
`apply_diff` only): their persistent batches, step inputs, sampling states and sampling metadata
(`PlainRows` and the `present` passes against the full `build_sampling_metadata`) must agree.
"""

from __future__ import annotations

import random
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from engine_svc.kv.kv_cache_manager import KVCacheManager
from engine_svc.request import Request, RequestStatus
from engine_svc.sample.metadata import SamplingMetadata, build_sampling_metadata
from engine_svc.sched.output import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from engine_svc.sched.scheduler import SampledLogprobs, Scheduler, _token_logprobs
from engine_svc.worker.model_runner import ModelRunner
from shared_runtime.contract import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineSamplingParams,
    EventType,
)


class GeneralPathKV(KVCacheManager):
    """Every allocation through the general path."""

    def allocate_slots(self, request: Request, num_new_tokens: int, new_computed_blocks: Any = None) -> Any:
        return self._allocate(request, num_new_tokens, new_computed_blocks, self._tables.get(request.request_id))


class ReferenceScheduler(Scheduler):
    """The per-token update as it was before its fast paths (8a43d40)."""

    def _on_sampled(self, request: Request, token: int, logprobs: SampledLogprobs | None) -> EngineCoreOutput:
        if request.grammar is not None and not request.grammar.accept(token):
            return self._grammar_violated(request, token)
        request.append_output_token(token)
        self.kv.hash_blocks(request)
        output = EngineCoreOutput(request_id=request.request_id, new_token_ids=[token],
                                  num_cached_tokens=max(request.num_cached_tokens, 0))
        if logprobs is not None:
            output.new_logprobs = [_token_logprobs(token, logprobs)]
        if not request.first_token_sent:
            request.first_token_sent = True
            request.record_event(EventType.FIRST_TOKEN)
            output.prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, []
        if self._reference_check_stop(request, token):
            self._release(request)
            request.record_event(EventType.FINISHED)
            output.finish_reason = request.finish_reason
            output.stop_token_id = request.stop_token_id
        output.events, request.pending_events = request.pending_events, []
        return output

    @staticmethod
    def _reference_check_stop(request: Request, token: int) -> bool:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens and (
            (token in request.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids
        ):
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_token_id = token
            return True
        if request.num_tokens >= request.max_total_tokens:
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def _make_output(self, scheduled: dict[str, int], grown: set[str]) -> SchedulerOutput:
        """Every cached request as a CachedRequestData, new blocks read from the block table (`grown`
        unused), no decode columns: the form before the columnar decodes."""
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        prompt_tokens: dict[str, int] = {}
        for request_id, n in scheduled.items():
            request = self.requests[request_id]
            tokens_sent = self._num_tokens_sent.get(request_id)
            if tokens_sent is None:
                new_reqs.append(self._new_request_data(request))
                self._num_blocks_sent[request_id] = len(new_reqs[-1].block_ids)
            else:
                blocks_sent = self._num_blocks_sent[request_id]
                new_blocks = self.kv.get_block_ids(request_id)[blocks_sent:]
                cached_reqs.append(CachedRequestData(
                    req_id=request_id, new_token_ids=request.all_token_ids[tokens_sent:], new_block_ids=new_blocks,
                    num_computed_tokens=request.num_computed_tokens))
                self._num_blocks_sent[request_id] = blocks_sent + len(new_blocks)
            self._num_tokens_sent[request_id] = len(request.all_token_ids)
            start = request.num_computed_tokens
            if start < request.num_prompt_tokens:
                prompt_tokens[request_id] = min(request.num_prompt_tokens - start, n)
            request.num_computed_tokens = start + n
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached_reqs, num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()), finished_req_ids=self._finished_ids,
            preempted_req_ids=self._preempted_ids, num_prompt_tokens=prompt_tokens, step_id=self._step_id,
        )
        self._finished_ids, self._preempted_ids = [], []
        return output

    def _count_prompt_tokens(self, scheduler_output: SchedulerOutput) -> int:
        total = 0
        for request_id, n in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is not None:
                start = request.num_computed_tokens - n
                total += max(0, min(request.num_prompt_tokens - start, n))
        return total


def _pair(caching: bool) -> tuple[Scheduler, Scheduler]:
    kwargs: dict[str, Any] = dict(max_num_seqs=8, max_num_batched_tokens=24, max_model_len=48, block_size=4,
                                  num_blocks=20, enable_prefix_caching=caching)
    fast, ref = Scheduler(**kwargs), ReferenceScheduler(**kwargs)
    ref.kv.__class__ = GeneralPathKV
    return fast, ref


def _add(sched: Scheduler, rid: str, prompt: list[int], eos: list[int], arrival: float, **params: Any) -> None:
    req = EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=EngineSamplingParams(**params),
                            eos_token_ids=eos, arrival_time=arrival)
    sched.add_request(Request(req, sched.max_model_len))


def _run(sched: Scheduler, so: SchedulerOutput, tokens: dict[str, int]) -> ModelRunnerOutput:
    """A fake model: a request samples its scripted token when its step reaches its last known token; the
    requests that asked for logprobs get a row."""
    req_ids = list(so.num_scheduled_tokens)
    sampled = [tokens[r] if sched.requests[r].num_computed_tokens == sched.requests[r].num_tokens else -1
               for r in req_ids]
    rows = [(-0.5, 1, [t], [-0.5]) if t >= 0 and sched.requests[r].sampling_params.logprobs is not None else None
            for r, t in zip(req_ids, sampled)]
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled,
                             logprobs=rows if any(x is not None for x in rows) else None)


def _per_request_form(so: SchedulerOutput) -> Any:
    """A SchedulerOutput with its decode columns expanded into per-request diffs, as builtins."""
    row = msgspec.to_builtins(msgspec.structs.replace(
        so, scheduled_cached_reqs=so.cached_diffs(), decode_req_ids=[], decode_token_ids=[],
        decode_num_computed_tokens=[]))
    return row


def _runner() -> ModelRunner:
    """A ModelRunner for state updates, step layout and sampling metadata only (no forward is run)."""
    return ModelRunner(torch.nn.Identity(), device=torch.device("cpu"), max_num_seqs=8, max_model_len=48,
                       block_size=4, vocab_size=64, max_num_batched_tokens=24)


def _worker_view(runner: ModelRunner, so: SchedulerOutput) -> list[Any]:
    """Apply one step to `runner` and return what it holds and lays out: per live request its known tokens,
    block table, computed count and sampling outputs; the step's inputs; the sampling rows' metadata."""
    runner._update_states(so)
    batch = runner.batch
    held = {}
    for rid, row in sorted(batch.row_of.items()):
        held[rid] = (batch.token_ids[row, : batch.num_tokens[row]].tolist(),
                     batch.block_table[row, : batch.num_blocks[row]].tolist(), int(batch.num_computed[row]),
                     list(runner.sampling_states[rid].output_token_ids))
    if not so.total_num_scheduled_tokens:
        return [held]
    inputs = batch.prepare(so.num_scheduled_tokens)
    laid_out = [inputs.req_ids, *(a.tolist() for a in (inputs.query_lens, inputs.seq_lens, inputs.input_ids,
                                                       inputs.positions, inputs.slot_mapping, inputs.block_table,
                                                       inputs.sample_mask, inputs.rows)), inputs.num_decodes]
    idx = np.flatnonzero(inputs.sample_mask)
    sample_ids = [inputs.req_ids[i] for i in idx.tolist()]
    meta = runner._sampling_metadata(sample_ids, inputs.rows[idx]) if sample_ids else None
    full = build_sampling_metadata([runner.sampling_states[r] for r in sample_ids], torch.device("cpu"))
    assert _meta(meta) == _meta(full) if sample_ids else True  # the shortcuts change no field
    return [held, laid_out, _meta(meta)]


def _meta(meta: SamplingMetadata | None) -> Any:
    if meta is None:
        return None
    mask = meta.min_tokens_mask
    return (meta.is_plain_greedy, meta.all_greedy, meta.num_logprobs,
            None if mask is None else (mask[0].tolist(), mask[1].tolist()))


def _comparable(out: EngineCoreOutputs) -> list[Any]:
    """The outputs with each event's time dropped (the two schedulers run at different instants)."""
    rows = []
    for o in out.outputs:
        row = msgspec.to_builtins(o)
        row["events"] = [e.type for e in o.events]
        rows.append(row)
    return [rows, msgspec.to_builtins(out.scheduler_stats)]


def _state(sched: Scheduler) -> list[Any]:
    return [sched.kv.num_free_blocks, sorted(sched.requests),
            {rid: (sched.kv.get_block_ids(rid), r.block_hashes, r.num_computed_tokens, r.status)
             for rid, r in sched.requests.items()},
            [r.request_id for r in sched.running]]


@pytest.mark.parametrize("caching", [True, False])
def test_fast_paths_match_the_general_path_step_by_step(caching: bool) -> None:
    rng = random.Random(20261127)
    fast, ref = _pair(caching)
    runner_fast, runner_ref = _runner(), _runner()
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 14))] for _ in range(3)]
    seen = {"all_decode": 0, "finish_in_decode": 0, "arrive_beside_decodes": 0, "preempted": 0, "stop_held": 0,
            "decode_columns": 0, "plain_step": 0, "mixed_step": 0}
    added = 0
    for _ in range(600):
        arriving = added < 60 and rng.random() < 0.4
        if arriving:
            params = dict(max_tokens=rng.randrange(1, 30), min_tokens=rng.choice([0, 0, 3]),
                          ignore_eos=rng.random() < 0.2, stop_token_ids=rng.choice([[], [], [5], [5, 6]]),
                          logprobs=rng.choice([None, None, 1]),
                          temperature=1.0 if added % 7 == 6 else 0.0)  # (no rng draw: the workload stays)
            params["min_tokens"] = min(params["min_tokens"], params["max_tokens"])
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 9))]
            for s in (fast, ref):
                _add(s, f"r{added}", prompt, [3], float(added), **params)
            added += 1
        if fast.requests and rng.random() < 0.02:
            victim = rng.choice(sorted(fast.requests))
            for s in (fast, ref):
                s.finish_requests([victim])
        preemptions = fast.num_preemptions
        so_fast, so_ref = fast.schedule(), ref.schedule()
        assert _per_request_form(so_fast) == _per_request_form(so_ref)
        assert not so_ref.decode_req_ids
        view = _worker_view(runner_fast, so_fast)
        assert view == _worker_view(runner_ref, so_ref)
        seen["decode_columns"] += bool(so_fast.decode_req_ids)
        if len(view) == 3 and view[2] is not None:
            seen["plain_step"] += view[2][0]
            seen["mixed_step"] += not view[2][0] and len(so_fast.decode_req_ids) > 1
        decodes = [r for r, n in so_fast.num_scheduled_tokens.items() if n == 1 and not so_fast.num_prompt_tokens.get(r)]
        all_decode = bool(decodes) and len(decodes) == len(so_fast.num_scheduled_tokens)
        tokens = {r: rng.randrange(3, 24) for r in so_fast.num_scheduled_tokens}  # 3 = EOS; 5, 6 stop ids
        held = [r for r, t in tokens.items() if t in (3, 5, 6) and r in decodes
                and fast.requests[r].num_output_tokens + 1 < fast.requests[r].sampling_params.min_tokens]
        out_fast = fast.update_from_output(so_fast, _run(fast, so_fast, tokens))
        out_ref = ref.update_from_output(so_ref, _run(ref, so_ref, tokens))
        assert _comparable(out_fast) == _comparable(out_ref)
        assert _state(fast) == _state(ref)
        finished = any(o.finished for o in out_fast.outputs)
        seen["all_decode"] += all_decode
        seen["finish_in_decode"] += all_decode and finished
        seen["arrive_beside_decodes"] += arriving and bool(decodes)
        seen["preempted"] += fast.num_preemptions > preemptions
        seen["stop_held"] += bool(held)
        if added == 60 and not fast.has_unfinished_requests():
            break
    assert not fast.has_unfinished_requests() and not ref.has_unfinished_requests()
    assert fast.kv.num_free_blocks == fast.kv.num_blocks
    assert all(seen.values()), seen  # the workload reached every case it is here for


def test_prepare_never_reuses_decode_rows_after_rows_moved() -> None:
    """`InputBatch.prepare` reuses the rows of the last `apply_decode_diffs` only while no request joined:
    here both requests leave and rejoin in swapped rows, and a step with no decode columns lays them out."""
    from engine_svc.worker.input_batch import InputBatch

    batch = InputBatch(max_num_reqs=4, max_model_len=16, block_size=4)
    batch.add("a", [1, 2, 3], [5], 3)
    batch.add("b", [7, 8, 9], [6], 3)
    batch.apply_decode_diffs(["a", "b"], [4, 10], [3, 3])
    batch.remove("a")
    batch.remove("b")
    batch.add("a", [1, 2, 3, 4], [5], 3)  # rows swapped: a takes b's old row
    batch.add("b", [7, 8, 9, 10], [6], 3)
    inputs = batch.prepare({"a": 1, "b": 1})
    assert inputs.rows.tolist() == [batch.row_of["a"], batch.row_of["b"]] == [1, 0]
    assert inputs.input_ids.tolist() == [4, 10] and inputs.slot_mapping.tolist() == [23, 27]
