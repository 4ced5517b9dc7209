"""The EngineCore contract as plain structs.

These mirror `tandem.engine.v1` (protos/tandem/engine/v1/engine_core.proto) field for field: the same
names, the same enum values. The in-process engine exchanges these; the engine service converts them
to and from protobuf at the gRPC edge. Consumers (the frontend's output processor) read attributes by
name, so they work on either form.

Invariants:
- `EngineCoreOutputs` is one message per engine step; it carries every request that produced something
  that step (new tokens, a finish, an error) and the scheduler stats after the step.
- A request appears with `finish_reason != UNSPECIFIED` (or an `error`) exactly once, in its last output.
"""

from __future__ import annotations

import enum

import msgspec


class FinishReason(enum.IntEnum):
    """Same numbers as `tandem.engine.v1.FinishReason` and the public `tandem.v1.FinishReason`."""

    UNSPECIFIED = 0
    STOP = 1  # EOS, a stop token id, or (frontend) a stop string
    LENGTH = 2  # max_tokens or the model's context limit
    ABORT = 3  # aborted by the client / frontend / a drain
    ERROR = 4  # the engine could not serve it; see EngineCoreOutput.error


class EventType(enum.IntEnum):
    """Same numbers as `tandem.engine.v1.RequestEventType`."""

    UNSPECIFIED = 0
    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3
    FIRST_TOKEN = 4
    FINISHED = 5


class ErrorCode(enum.IntEnum):
    """gRPC status codes the frontend maps an engine error to (values = grpc.StatusCode numbers)."""

    UNSPECIFIED = 0
    INVALID_ARGUMENT = 3
    RESOURCE_EXHAUSTED = 8
    INTERNAL = 13
    UNAVAILABLE = 14


class EngineSamplingParams(msgspec.Struct, kw_only=True):
    """Sampling as the engine sees it: token-level only (stop strings are the frontend's business).

    `temperature == 0` means greedy. `max_tokens is None` means "up to max_model_len".
    `top_k <= 0` (or >= vocab) disables top-k; `top_p == 1` and `min_p == 0` disable those filters.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top-N logprobs per sampled token (0 = only the sampled token's)
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token


class EngineCoreRequest(msgspec.Struct, kw_only=True):
    """One request to the engine: token ids in, token ids out. n is always 1 here."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: EngineSamplingParams
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    arrival_time: float = 0.0
    priority: int = 0
    trace_headers: dict[str, str] = msgspec.field(default_factory=dict)


class TokenLogprobs(msgspec.Struct, kw_only=True, array_like=True, gc=False):
    """Logprob of one position: the chosen token, its rank in the distribution (1 = most likely),
    and the top-N alternatives in descending order."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int] = msgspec.field(default_factory=list)
    top_logprobs: list[float] = msgspec.field(default_factory=list)


class RequestEvent(msgspec.Struct, array_like=True, gc=False):
    """A scheduling event with the engine's wall-clock timestamp (time.time())."""

    type: EventType
    timestamp: float


class EngineError(msgspec.Struct, kw_only=True, gc=False):
    code: ErrorCode
    message: str


class EngineCoreOutput(msgspec.Struct, kw_only=True, gc=False):
    """What one request produced in one step."""

    request_id: str
    new_token_ids: list[int] = msgspec.field(default_factory=list)
    new_logprobs: list[TokenLogprobs] = msgspec.field(default_factory=list)
    # Sent once, with the request's first output, when prompt_logprobs was asked for. Position 0 has no
    # logprob (nothing precedes it), so this holds len(prompt) - 1 entries, for positions 1..len-1.
    prompt_logprobs: list[TokenLogprobs] = msgspec.field(default_factory=list)
    finish_reason: FinishReason = FinishReason.UNSPECIFIED
    stop_token_id: int | None = None  # the EOS / stop token that finished it, if one did
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first schedule)
    events: list[RequestEvent] = msgspec.field(default_factory=list)
    error: EngineError | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason != FinishReason.UNSPECIFIED


class SchedulerStats(msgspec.Struct, kw_only=True, gc=False):
    """Load after a step; frontends route on (num_running + num_waiting)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # blocks in use / total blocks, in [0, 1]
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_queries: int = 0  # cumulative, in tokens
    prefix_cache_hits: int = 0  # cumulative, in tokens
    num_preemptions: int = 0  # cumulative
    num_scheduled_tokens: int = 0  # this step
    num_prompt_tokens: int = 0  # this step: prompt tokens computed
    num_generation_tokens: int = 0  # this step: tokens sampled


class EngineCoreOutputs(msgspec.Struct, kw_only=True, gc=False):
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
