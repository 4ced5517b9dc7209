"""What the frontend hands back: per-step `CompletionDelta`s and, for the offline API, whole
`RequestOutput`s folded from them by `RequestOutputAccumulator`.

Invariants:
- Concatenating `text` (and `token_ids`, `logprobs`) over one completion's deltas gives its final
  output; exactly one delta per completion has `finish_reason` set, and it is that completion's last.
- `usage` is set on (and only on) a completion's last delta; `prompt_logprobs` only on its first.
- `CompletionDelta.merge` keeps both: the merge of consecutive deltas is itself a valid delta.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from frontend_svc.processor import PreparedRequest


@dataclass(slots=True)
class TokenLogprob:
    """Logprob of one position: the chosen token, its rank (1 = most likely), the top-N alternatives
    as (token_id, logprob) in descending order, and the chosen token's text when it was decoded."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)
    text: str | None = None
    top_texts: list[str] | None = None  # the alternatives' texts where one differs from its own decode


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0


@dataclass(slots=True)
class CompletionError:
    """An engine-reported failure: `code` is a gRPC status code number."""

    code: int
    message: str


@dataclass(slots=True)
class CompletionDelta:
    """New output of one completion (index) of one client request, since its previous delta."""

    request_id: str  # the client's id
    index: int
    text: str
    token_ids: list[int]
    engine_request_id: str = ""  # process-unique; tells apart requests that share a client id
    logprobs: list[TokenLogprob] | None = None  # None unless logprobs were requested
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the matched stop string or the stop token id
    usage: Usage | None = None
    error: CompletionError | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # positions 1..len(prompt)-1
    # On a finished delta whose engine kept the prompt's K/V for a decode server (openai/kv_transfer.py).
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, later: CompletionDelta) -> None:
        """Fold `later` (the next delta of the same completion) into this one, so that this delta says
        what both said: text, ids and logprobs concatenated; the finish fields, usage and error come
        from `later` once it finished; prompt logprobs (only ever on a completion's first delta) stay."""
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        if later.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(later.logprobs)
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
        if later.finish_reason is not None:
            self.finish_reason, self.stop_reason = later.finish_reason, later.stop_reason
            self.usage, self.error = later.usage, later.error
            self.kv_transfer_params = later.kv_transfer_params


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs, when requested
    error: CompletionError | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's outputs so far, vLLM-style. `prompt_logprobs[0]` is None (nothing precedes it)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0
    finished: bool = False


class RequestOutputAccumulator:
    """Folds `CompletionDelta`s into `RequestOutput`s, keyed by the client request id.

    Client ids must be unique among the requests added here (the offline API assigns them).
    """

    def __init__(self) -> None:
        self._outputs: dict[str, RequestOutput] = {}
        self._unfinished: dict[str, int] = {}

    def add_request(self, prepared: PreparedRequest, prompt: str | None = None) -> None:
        n = len(prepared.engine_request_ids)
        self._outputs[prepared.request_id] = RequestOutput(
            request_id=prepared.request_id,
            prompt=prompt if prompt is not None else prepared.prompt,
            prompt_token_ids=list(prepared.prompt_token_ids),
            outputs=[_empty_completion(i, prepared) for i in range(n)],
        )
        self._unfinished[prepared.request_id] = n

    def add_delta(self, delta: CompletionDelta) -> bool:
        """Fold one delta in; True when it finished the last unfinished completion of its request."""
        request = self._outputs[delta.request_id]
        completion = request.outputs[delta.index]
        completion.text += delta.text
        completion.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None and completion.logprobs is not None:
            completion.logprobs.extend(delta.logprobs)
            completion.cumulative_logprob = (completion.cumulative_logprob or 0.0) + sum(
                entry.logprob for entry in delta.logprobs)
        if delta.prompt_logprobs is not None and request.prompt_logprobs is None:
            request.prompt_logprobs = [None, *delta.prompt_logprobs]
        if not delta.finished:
            return False
        completion.finish_reason = delta.finish_reason
        completion.stop_reason = delta.stop_reason
        completion.error = delta.error
        if delta.usage is not None:
            request.num_cached_tokens = max(request.num_cached_tokens, delta.usage.cached_prompt_tokens)
        self._unfinished[delta.request_id] -= 1
        request.finished = self._unfinished[delta.request_id] == 0
        return request.finished

    def get(self, request_id: str) -> RequestOutput:
        return self._outputs[request_id]

    def pop(self, request_id: str) -> RequestOutput:
        self._unfinished.pop(request_id, None)
        return self._outputs.pop(request_id)


def _empty_completion(index: int, prepared: PreparedRequest) -> CompletionOutput:
    wants_logprobs = prepared.params.logprobs is not None
    return CompletionOutput(
        index=index,
        logprobs=[] if wants_logprobs else None,
        cumulative_logprob=0.0 if wants_logprobs else None,
    )
