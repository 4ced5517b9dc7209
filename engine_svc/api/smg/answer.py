"""One SMG Generate call's answer: engine outputs (the contract's structs) -> `GenerateResponse` messages.

The shape is that of SMG's own vLLM servicer, which the gateway is written against:
- stream=true: a `chunk` per step per sample with new tokens (`token_ids` and `output_logprobs` are
  that step's delta, `completion_tokens` its count; `input_logprobs` on a sample's first chunk), then,
  when the sample ends, a `complete` holding the last step's delta again with the finish reason;
- stream=false: when every sample has ended, one `complete` per sample in index order, with all of
  its tokens and logprobs;
- `finish_reason` is "stop", "length" or "abort"; `matched_token_id` is set when a stop token id
  (not EOS) ended the sample, `matched_stop_str` when a stop string did (stops.py);
- `index` is the sample's position among the n;
- a prefill leg's `complete` carries `kv_transfer_params_json` (the handoff its engine kept, which SMG
  relays to the decode leg) and its legacy typed mirror (host and port).
An error output (a refused request, a full admission queue, a draining engine) raises `EngineFailure`;
the servicer ends the call with its status.

Invariant: each sample gets exactly one `complete`; outputs that arrive for a sample after it ended (a
step queued before the engine heard the stop-string abort) are dropped.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from tandem.vendor.smg import vllm_engine_pb2 as vpb

from engine_svc.api.smg.request import SmgPlan
from engine_svc.api.smg.stops import SampleStops
from shared_runtime.contract import EngineCoreOutput, ErrorCode, FinishReason, TokenLogprobs
from shared_runtime.kv_transfer_params import handoff

_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}


class EngineFailure(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class _Sample:
    __slots__ = ("cached", "count", "ended", "first_sent", "ids", "index", "logprobs", "stop_ids", "stops")

    def __init__(self, index: int, stop_ids: frozenset[int], stops: SampleStops | None) -> None:
        self.index = index
        self.stop_ids = stop_ids
        self.stops = stops
        self.ids: list[int] = []  # all tokens (stream=false only)
        self.logprobs: list[TokenLogprobs] = []  # all logprobs (stream=false only)
        self.count = 0
        self.cached = 0
        self.first_sent = False
        self.ended = False


class SmgAnswer:
    """The state of one Generate call's samples; `on_output` turns one engine output into messages."""

    def __init__(self, plan: SmgPlan, stops: Sequence[SampleStops] | None) -> None:
        self.plan = plan
        self._by_id = {child.request_id: _Sample(i, frozenset(child.sampling_params.stop_token_ids),
                                                 stops[i] if stops else None)
                       for i, child in enumerate(plan.children)}
        self._min_tokens = plan.children[0].sampling_params.min_tokens
        self._prompt_logprobs: list[TokenLogprobs] = []
        self._open = len(self._by_id)
        self._finished: list[vpb.GenerateResponse] = []  # stream=false: completes until all have ended

    @property
    def done(self) -> bool:
        return self._open == 0

    def on_output(self, out: EngineCoreOutput) -> tuple[list[vpb.GenerateResponse], bool]:
        """The messages to send for `out`, and whether a stop string ended its sample (the servicer then
        aborts it in the engine). Raises `EngineFailure` for an error output."""
        sample = self._by_id.get(out.request_id)
        if sample is None or sample.ended:
            return [], False
        if out.error is not None:
            raise EngineFailure(out.error.code, out.error.message)
        if out.prompt_logprobs:
            self._prompt_logprobs = out.prompt_logprobs
        sample.cached = max(sample.cached, out.num_cached_tokens)
        new = out.new_token_ids
        sample.count += len(new)
        matched = None
        if sample.stops is not None and new:
            matched = sample.stops.feed(new, allow_stop=sample.count >= self._min_tokens)
        finish = "stop" if matched is not None else _FINISH.get(out.finish_reason)
        messages: list[vpb.GenerateResponse] = []
        if self.plan.stream:
            if new:
                messages.append(self._chunk(sample, out))
        else:
            sample.ids.extend(new)
            sample.logprobs.extend(out.new_logprobs)
        if finish is not None:
            sample.ended = True
            self._open -= 1
            done = self._complete(sample, out, finish, matched)
            if self.plan.stream:
                messages.append(done)
            else:
                self._finished.append(done)
                if self.done:
                    messages.extend(sorted(self._finished, key=lambda m: m.complete.index))
        return messages, matched is not None

    def _chunk(self, sample: _Sample, out: EngineCoreOutput) -> vpb.GenerateResponse:
        chunk = vpb.GenerateStreamChunk(token_ids=out.new_token_ids, prompt_tokens=len(self.plan.prompt_token_ids),
                                        completion_tokens=len(out.new_token_ids), cached_tokens=sample.cached,
                                        index=sample.index)
        if self.plan.logprobs is not None:
            _output_logprobs(chunk.output_logprobs, out.new_logprobs, self.plan.logprobs)
        if not sample.first_sent:
            sample.first_sent = True
            if self.plan.prompt_logprobs is not None:
                self._input_logprobs(chunk.input_logprobs)
        return vpb.GenerateResponse(chunk=chunk)

    def _complete(self, sample: _Sample, out: EngineCoreOutput, finish: str,
                  matched: str | None) -> vpb.GenerateResponse:
        ids, logprobs = (out.new_token_ids, out.new_logprobs) if self.plan.stream else (sample.ids, sample.logprobs)
        done = vpb.GenerateComplete(output_ids=ids, finish_reason=finish,
                                    prompt_tokens=len(self.plan.prompt_token_ids), completion_tokens=len(ids),
                                    cached_tokens=sample.cached, index=sample.index)
        if matched is not None:
            done.matched_stop_str = matched
        elif out.stop_token_id is not None and out.stop_token_id in sample.stop_ids:
            done.matched_token_id = out.stop_token_id
        if self.plan.logprobs is not None:
            _output_logprobs(done.output_logprobs, logprobs, self.plan.logprobs)
        if self.plan.prompt_logprobs is not None:
            self._input_logprobs(done.input_logprobs)
        if out.kv_transfer_params is not None:  # a prefill leg's kept blocks: the handoff SMG relays to decode
            kept = out.kv_transfer_params
            done.kv_transfer_params_json = json.dumps(handoff(kept), separators=(",", ":"))
            done.kv_transfer_params.remote_host, done.kv_transfer_params.remote_port = kept.remote_host, kept.remote_port
        return vpb.GenerateResponse(complete=done)

    def _input_logprobs(self, into: vpb.InputLogProbs) -> None:
        """Every prompt position; the first has no value (nothing precedes it), as vLLM sends it."""
        prompt = self.plan.prompt_token_ids
        into.token_ids.extend(prompt)
        into.token_logprobs.add()
        top = self.plan.prompt_logprobs
        if top:
            into.top_logprobs.add()
        for lp in self._prompt_logprobs:
            into.token_logprobs.add(value=lp.logprob)
            if top:
                into.top_logprobs.add(values=lp.top_logprobs[:top], token_ids=lp.top_token_ids[:top])


def _output_logprobs(into: vpb.OutputLogProbs, logprobs: Sequence[TokenLogprobs], top: int) -> None:
    for lp in logprobs:
        into.token_logprobs.append(lp.logprob)
        into.token_ids.append(lp.token_id)
        if top:
            into.top_logprobs.add(values=lp.top_logprobs[:top], token_ids=lp.top_token_ids[:top])

