"""A request's state inside the engine.

There is no prefill or decode phase: a request has `num_tokens` known tokens (prompt + output so far)
of which `num_computed_tokens` have K/V in the cache. Each step the scheduler hands it up to
`num_tokens - num_computed_tokens` tokens; chunked prefill, prefix hits and decode all fall out of that.
Preemption (recompute) resets `num_computed_tokens` to 0 and keeps the output tokens. A continuation
(a request migrated from another engine) arrives in that same state: its outputs so far, nothing computed.

With steps in flight (the engine core's batch queue), `num_output_placeholders` counts the tokens this
request will sample in scheduled steps whose results the scheduler has not seen yet; under async scheduling
the scheduler computes those positions before it knows their ids (vLLM's output placeholders), so the
request's scheduling horizon is `num_tokens + num_output_placeholders`. `last_scheduled_step` is the id of
the last step that scheduled it. With speculative decoding under async scheduling a verifying step counts
1 + k placeholders (as if its k draft places were all accepted); `num_spec_in_flight` is the k's of those
steps, so that `num_output_placeholders - num_spec_in_flight` is the number of sampling steps in flight.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from shared_runtime.contract import (
    EngineCoreRequest,
    EngineSamplingParams,
    EventType,
    FinishReason,
    KvTransferParams,
    RequestEvent,
    TokenLogprobs,
)

if TYPE_CHECKING:
    from engine_svc.kv_transfer.puller import PullResult
    from engine_svc.structured.compiler import Ticket
    from engine_svc.structured.grammar import RequestGrammar


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # waiting again, after its blocks were taken back
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6
    WAITING_FOR_FSM = 7  # waiting for its grammar to compile (structured outputs); not yet queued
    WAITING_FOR_REMOTE_KVS = 8  # pulling its prompt's K/V from a producer engine (kv_transfer/); not yet queued

    @property
    def is_finished(self) -> bool:
        return RequestStatus.FINISHED_STOPPED <= self <= RequestStatus.FINISHED_ERROR


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """Mutable per-request state owned by the scheduler (engine process only)."""

    def __init__(self, req: EngineCoreRequest, max_model_len: int) -> None:
        self.request_id: str = req.request_id
        self.prompt_token_ids: list[int] = list(req.prompt_token_ids)
        self.sampling_params: EngineSamplingParams = req.sampling_params
        self.eos_token_ids: frozenset[int] = frozenset(req.eos_token_ids)
        self.arrival_time: float = req.arrival_time or time.time()
        self.priority: int = req.priority
        self.trace_headers: dict[str, str] = dict(req.trace_headers)
        # LoRA: the adapter's name ("" = base model) and its id (set by the scheduler on admission; 0 = base).
        # The adapter keys every block hash, so KV computed under one adapter never serves another.
        self.lora_name: str = req.lora_name
        self.lora_id: int = 0
        self.lora_fingerprint: str = ""  # its content fingerprint, set with the id (keys its blocks; KV events)
        self.block_hash_extra_keys: tuple[str, ...] = (req.lora_name,) if req.lora_name else ()

        # A continuation (`output_token_ids`: generated on another engine) starts with its outputs so far,
        # exactly as a request resumed after preemption: they count as output everywhere.
        self.output_token_ids: list[int] = list(req.output_token_ids)
        self.all_token_ids: list[int] = self.prompt_token_ids + self.output_token_ids
        self.num_computed_tokens: int = 0
        self.num_cached_tokens: int = -1  # prefix-cache hit at first schedule; -1 until then
        self.status: RequestStatus = RequestStatus.WAITING
        self.num_preemptions: int = 0
        self.num_output_placeholders: int = 0  # samples scheduled whose token the scheduler has not seen yet
        self.last_scheduled_step: int = -1  # SchedulerOutput.step_id of its last schedule
        self.num_spec_in_flight: int = 0  # draft places among num_output_placeholders (async speculation)
        self.stop_token_id: int | None = None
        self.spec_token_ids: list[int] = []  # drafts to verify when next scheduled (speculative decoding)
        # Largest total length this request may reach: prompt + max_tokens, capped by the context.
        max_tokens = req.sampling_params.max_tokens
        limit = max_model_len if max_tokens is None else len(self.prompt_token_ids) + max_tokens
        self.max_total_tokens: int = min(limit, max_model_len)

        # Chained block hashes of the full blocks of all_token_ids (filled by the KV cache manager).
        self.block_hashes: list[bytes] = []
        # Things to report in the next EngineCoreOutput for this request. Event times are the engine's
        # own clock (QUEUED = received here), so intervals between them never mix two hosts' clocks.
        self.pending_events: list[RequestEvent] = [RequestEvent(EventType.QUEUED, time.time())]
        self.prompt_logprobs: list[TokenLogprobs] = []
        self.first_token_sent: bool = False
        # Structured outputs: the compile this request waits for, then its matcher (None: unconstrained).
        self.grammar_ticket: Ticket | None = None
        self.grammar: RequestGrammar | None = None
        # The tokens that stop it once it has min_tokens outputs: its EOS ids (unless ignore_eos) and its
        # stop_token_ids. Set by `set_stop_tokens` once the request is validated; checked per sampled token.
        self.stop_token_set: frozenset[int] = frozenset()
        # Prefill/decode disaggregation (engine_svc/kv_transfer/): what was asked, the pulled K/V waiting
        # for admission, and (producer) where the kept blocks are, for the last output.
        self.kv_transfer_params: KvTransferParams | None = req.kv_transfer_params
        self.kv_load: PullResult | None = None
        self.kv_transfer_out: KvTransferParams | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason:
        return _FINISH_REASON.get(self.status, FinishReason.UNSPECIFIED)

    def set_stop_tokens(self) -> None:
        """Fill `stop_token_set` from the sampling params (valid ones: call after validation)."""
        params = self.sampling_params
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        self.stop_token_set = eos | frozenset(params.stop_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def record_event(self, kind: EventType) -> None:
        self.pending_events.append(RequestEvent(kind, time.time()))

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
