"""`CompletionDelta`s -> vLLM's `vllm.GenerateResponse`s.

A stream is vLLM's: one `prompt_info` response first (prompt length; prompt ids and logprobs when asked
for), then one `outputs` response per delta of a sequence, its last one with `finish_info`. The unary
`Generate` folds one sequence's deltas into one response holding both.

Invariants (vLLM's shapes):
- `num_tokens` is the number of tokens in the chunk, whether or not `token_ids` are returned.
- Output logprobs are parallel arrays, one entry per token: the chosen token's `logprobs` and `ranks`,
  and its `candidate_tokens` (the top-N alternatives with their rank, most likely first).
- Prompt logprobs cover every prompt position: the first has none and is written as 0 / rank 0 / no
  candidates.
- A stop by EOS reports `eos_token_id` (the last token); a stop by one of the request's stop ids
  `stop_token_id`; a stop string `stop_string`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tandem.vendor.vllm import inference_pb2 as ipb

from frontend_svc.outputs import CompletionDelta, TokenLogprob
from frontend_svc.vllm_grpc.request import ResponseShape

_FINISH = {"stop": ipb.FinishInfo.STOP, "length": ipb.FinishInfo.LENGTH}


class ResponseWriter:
    """Builds one request's responses; keeps what a sequence's finish needs (its token count, last id)."""

    def __init__(self, shape: ResponseShape, stop_token_ids: Iterable[int]) -> None:
        self.shape = shape
        self._stop_ids = frozenset(stop_token_ids)
        self._num_tokens: dict[int, int] = {}
        self._last_token: dict[int, int] = {}

    def prompt_info(self, prompt_token_ids: Sequence[int],
                    prompt_logprobs: Sequence[TokenLogprob] | None) -> ipb.GenerateResponse:
        info = ipb.PromptInfo(num_prompt_tokens=len(prompt_token_ids))
        if self.shape.prompt_token_ids:
            info.token_ids.extend(prompt_token_ids)
        if self.shape.prompt_logprobs and prompt_logprobs is not None:
            info.logprobs.append(0.0)
            info.ranks.append(0)
            info.candidate_tokens.add()
            _logprobs_into(info, prompt_logprobs)
        return ipb.GenerateResponse(prompt_info=info)

    def outputs(self, delta: CompletionDelta) -> ipb.GenerateResponse:
        response = ipb.GenerateResponse()
        self.sequence_into(response.outputs, delta)
        return response

    def sequence_into(self, out: ipb.SequenceOutput, delta: CompletionDelta) -> None:
        """Write one delta of sequence `delta.index` into `out` (a fresh SequenceOutput)."""
        shape, index, ids = self.shape, delta.index, delta.token_ids
        out.index = index
        out.num_tokens = len(ids)
        if shape.output_text:
            out.text = delta.text
        if shape.output_token_ids:
            out.token_ids.extend(ids)
        if shape.output_logprobs and delta.logprobs:
            _logprobs_into(out, delta.logprobs)
        total = self._num_tokens.get(index, 0) + len(ids)
        self._num_tokens[index] = total
        if ids:
            self._last_token[index] = ids[-1]
        if delta.finish_reason is not None:
            self._finish_into(out.finish_info, delta, total)

    def _finish_into(self, info: ipb.FinishInfo, delta: CompletionDelta, total: int) -> None:
        info.num_output_tokens = total
        info.finish_reason = _FINISH.get(delta.finish_reason or "", ipb.FinishInfo.ABORTED)
        if delta.finish_reason != "stop":
            return
        reason = delta.stop_reason
        if isinstance(reason, str):
            info.stop_string = reason
        elif reason is not None and reason in self._stop_ids:
            info.stop_token_id = reason
        elif reason is not None:
            info.eos_token_id = reason
        elif delta.index in self._last_token:
            info.eos_token_id = self._last_token[delta.index]


def _logprobs_into(out: ipb.SequenceOutput | ipb.PromptInfo, entries: Sequence[TokenLogprob]) -> None:
    logprobs, ranks, candidates = out.logprobs, out.ranks, out.candidate_tokens
    for entry in entries:
        logprobs.append(entry.logprob)
        ranks.append(entry.rank)
        position = candidates.add()
        for rank, (token_id, logprob) in enumerate(entry.top, start=1):
            position.tokens.add(id=token_id, logprob=logprob, rank=rank)


def fold(responses: Sequence[ipb.GenerateResponse]) -> ipb.GenerateResponse:
    """The unary `Generate` answer: the prompt info and one sequence's outputs, concatenated."""
    folded = ipb.GenerateResponse()
    out = folded.outputs
    for response in responses:
        if response.HasField("prompt_info"):
            folded.prompt_info.CopyFrom(response.prompt_info)
        if not response.HasField("outputs"):
            continue
        part = response.outputs
        out.index = part.index
        out.text += part.text
        out.num_tokens += part.num_tokens
        out.token_ids.extend(part.token_ids)
        out.logprobs.extend(part.logprobs)
        out.ranks.extend(part.ranks)
        out.candidate_tokens.extend(part.candidate_tokens)
        if part.HasField("finish_info"):
            out.finish_info.CopyFrom(part.finish_info)
    return folded
