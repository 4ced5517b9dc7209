"""The request contract: one definition of what a request asks for and what the engine answers.

Both services and the offline API use these msgspec structs (no torch, no protobuf):

- `SamplingParams` is how to sample one client request, with vLLM's names and defaults. The frontend's
  API mappers build it (frontend_svc/grpc_api/wire.py for gRPC, frontend_svc/openai/bodies.py for OpenAI),
  the offline `LLM` takes it from its caller. Constructing one normalizes it (a single stop string
  becomes a list) and validates it.
- `EngineSamplingParams` is its token-level part, the part that crosses the link: `SamplingParams` is
  an `EngineSamplingParams` plus what only the frontend acts on (`stop`, `include_stop_str_in_output`,
  `n`, `skip_special_tokens`, `stream_interval`). `SamplingParams.engine_params()` copies every engine
  field, so a new token-level field is declared once, here (and in the protos, and mapped from each
  public API).
- `EngineCoreRequest` is one engine request (n is always 1 there), built by the frontend's `Processor`
  and handed to the engine as it is (offline) or through protobuf (shared_runtime/to_pb.py, then
  shared_runtime/from_pb.py on the engine).
- `violations()` is the one set of sampling rules: ranges, n, logprobs, stop limits, min/max tokens,
  ids against the vocabulary. The frontend prefixes its results with the public field path; the engine
  (engine_svc/validation.py) runs the same rules on what arrives over the wire. The bounds live in
  shared_runtime/limits.py.
- The output structs (`EngineCoreOutputs` and below) are what the engine core produces each step. They
  mirror `tandem.engine.v1` field for field (the same names and enum numbers).

Why the frontend reads engine outputs as protobuf, not as these structs: outputs are the per-token
path. The engine converts one step's structs to protobuf once, on its asyncio thread, and the frontend's
output processor reads the received `tandem.engine.v1.EngineCoreOutputs` directly - also typed, by its
generated stubs. Converting it back to structs in the frontend would more than double the cost of reading
an output (`python bench/output_shapes.py`; BENCHMARKS.md, "Which shape the frontend reads engine outputs
in"). The offline API converts its in-process step to protobuf the same way (shared_runtime/to_pb.py), so
the output processor has exactly one input shape.

Invariants:
- `EngineCoreOutputs` is one message per engine step; it carries every request that produced something
  that step (new tokens, a finish, an error) and the scheduler stats after the step.
- A request appears with `finish_reason != UNSPECIFIED` (or an `error`) exactly once, in its last output.
- The engine never mutates a request's sampling params (offline, they are shared with the caller's).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from numbers import Integral, Real
from typing import Any

import msgspec

from shared_runtime import grammar_bounds, limits
from shared_runtime.violations import FieldViolation, ValidationError

# ---- requests ----------------------------------------------------------------------------------------


class StructuredOutputs(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """One output constraint (vLLM's `StructuredOutputsParams`); exactly one field is set.

    `json` is a JSON schema as JSON text (property order is kept: it is the order the output follows);
    `json_object` asks for any JSON object; `regex` for a full match; `choice` for one of the strings;
    `grammar` is EBNF (xgrammar / GBNF syntax, a `root` rule); `structural_tag` is xgrammar's structural
    tag as JSON text. The engine compiles it (engine_svc/structured/) and masks every sampled token to it.
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None

    def kinds(self) -> list[str]:
        """The names of the fields that are set (one, when valid)."""
        return [name for name in STRUCTURED_KINDS if getattr(self, name) not in (None, False)]

    def spec_bytes(self) -> int:
        """Size of the constraint's text (all choices together); a bound, so it stops counting early."""
        texts = self.choice or [self.json or self.regex or self.grammar or self.structural_tag or ""]
        total = 0
        for text in texts:
            total += len(text) if len(text) > limits.MAX_STRUCTURED_OUTPUT_BYTES else len(text.encode())
            if total > limits.MAX_STRUCTURED_OUTPUT_BYTES:
                break
        return total


STRUCTURED_KINDS: tuple[str, ...] = StructuredOutputs.__struct_fields__


class EngineSamplingParams(msgspec.Struct, kw_only=True):
    """Sampling as the engine sees it: token-level only (stop strings are the frontend's business).

    `temperature == 0` means greedy. `max_tokens is None` means "up to max_model_len".
    `top_k <= 0` (or >= vocab) disables top-k; `top_p == 1` and `min_p == 0` disable those filters.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
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
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)  # token id -> added to its logit
    allowed_token_ids: list[int] = msgspec.field(default_factory=list)  # sample only these; empty = all
    # Banned sequences: the last id of one is masked while the output ends with the ids before it.
    bad_words_token_ids: list[list[int]] = msgspec.field(default_factory=list)
    structured_outputs: StructuredOutputs | None = None  # a grammar every sampled token must follow

    def violations(self, vocab_size: int | None = None) -> list[FieldViolation]:
        """Every problem with these params (bare field names); empty when they are valid. Token ids are
        checked against `vocab_size` when it is known."""
        return sampling_violations(self, (), 1, vocab_size)


ENGINE_FIELDS: tuple[str, ...] = EngineSamplingParams.__struct_fields__


class SamplingParams(EngineSamplingParams, kw_only=True):
    """How to sample one client request (vLLM's `SamplingParams`): the engine's fields plus the text-level
    ones the frontend acts on. Constructing one normalizes and validates it (`ValidationError`, which is
    a `ValueError`, naming every bad field).

    Invariant: `stop` is a list of at most `MAX_STOP_STRINGS` non-empty strings of at most
    `MAX_STOP_STRING_CHARS` characters; `stop_token_ids` a list of at most `MAX_TOKEN_IDS` ids;
    `logit_bias` maps at most `MAX_LOGIT_BIAS` token ids to biases clamped to [-100, 100].
    """

    max_tokens: int | None = 16  # vLLM's default; None = fill the context window
    stop: list[str] = msgspec.field(default_factory=list)  # a single string is accepted too
    include_stop_str_in_output: bool = False
    n: int = 1
    skip_special_tokens: bool = True
    # Words never to generate (vLLM's bad_words); the frontend's processor tokenizes them into
    # `bad_words_token_ids` (`bad_words_sequences`).
    bad_words: list[str] = msgspec.field(default_factory=list)
    # Streamed output in chunks of at least this many tokens (vLLM's per-request `stream_interval`):
    # the frontend's output path, with the server's `--stream-interval` as the floor. None: the server's.
    stream_interval: int | None = None

    def __post_init__(self) -> None:
        stop: object = self.stop
        if stop is None:
            self.stop = []
        elif isinstance(stop, str):
            self.stop = [stop]
        elif not isinstance(stop, list):
            self.stop = list(self.stop)
        stop_ids: object = self.stop_token_ids
        if stop_ids is None:
            self.stop_token_ids = []
        elif not isinstance(stop_ids, list):
            self.stop_token_ids = list(self.stop_token_ids)
        if self.bad_words is None:
            self.bad_words = []
        elif isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        elif all(isinstance(w, str) for w in self.bad_words) and len(set(self.bad_words)) < len(self.bad_words):
            self.bad_words = list(dict.fromkeys(self.bad_words))  # as vLLM
        allowed: object = self.allowed_token_ids
        if allowed is None:
            self.allowed_token_ids = []
        elif not isinstance(allowed, list):
            self.allowed_token_ids = list(self.allowed_token_ids)
        bias: object = self.logit_bias
        if bias is None:
            self.logit_bias = {}
        elif isinstance(bias, dict):  # clamped to [-100, 100], as vLLM does
            self.logit_bias = {token: _clamped(value) for token, value in bias.items()}
        self.validate()

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise `ValidationError` listing every bad field (bare names, e.g. `top_p`)."""
        violations = self.violations(vocab_size)
        if violations:
            raise ValidationError(violations)

    def violations(self, vocab_size: int | None = None) -> list[FieldViolation]:
        bad = sampling_violations(self, self.stop, self.n, vocab_size)
        _check_bad_words(bad, self.bad_words)
        interval = self.stream_interval
        if interval is not None and (not _is_int(interval) or not 1 <= interval <= limits.INT32_MAX):
            bad.append(FieldViolation("stream_interval", f"must be an integer in [1, 2**31), got {interval!r}"))
        return bad

    def engine_params(self, seed_offset: int = 0) -> EngineSamplingParams:
        """The token-level params of one engine request: every `EngineSamplingParams` field (lists and
        maps copied: the request owns them), the seed offset by `seed_offset` (completion i of n samples
        with seed + i, so they differ), a temperature below `GREEDY_TEMPERATURE` sent as 0 (greedy)."""
        fields: dict[str, Any] = {name: _own(getattr(self, name)) for name in ENGINE_FIELDS}
        engine = EngineSamplingParams(**fields)
        if engine.temperature < limits.GREEDY_TEMPERATURE:
            engine.temperature = 0.0
        if engine.seed is not None:
            engine.seed = (engine.seed + seed_offset) % limits.UINT64_LIMIT
        return engine


def _own(value: object) -> object:
    return value.copy() if isinstance(value, (list, dict)) else value


def sampling_violations(p: EngineSamplingParams, stop: Sequence[str], n: int,
                        vocab_size: int | None) -> list[FieldViolation]:
    """The sampling rules, for either side: `p`'s fields, and the frontend's `stop` and `n` (the engine
    passes none and 1). Messages are built only for what fails."""
    bad: list[FieldViolation] = []

    def add(name: str, description: str) -> None:
        bad.append(FieldViolation(name, description))

    if not _is_finite(p.temperature) or not 0 <= p.temperature <= limits.MAX_TEMPERATURE:
        add("temperature", f"must be in [0, {limits.MAX_TEMPERATURE:g}], got {p.temperature!r}")
    elif p.temperature < limits.GREEDY_TEMPERATURE and _is_int(n) and n > 1:
        add("n", f"must be 1 when using greedy sampling (temperature 0), got {n}")  # as vLLM
    if not _is_finite(p.top_p) or not 0 < p.top_p <= 1:
        add("top_p", f"must be in (0, 1], got {p.top_p!r}")
    if not _is_int(p.top_k) or not -1 <= p.top_k <= limits.INT32_MAX:
        add("top_k", f"must be -1, 0 (disabled) or a positive integer below 2**31, got {p.top_k!r}")
    if not _is_finite(p.min_p) or not 0 <= p.min_p <= 1:
        add("min_p", f"must be in [0, 1], got {p.min_p!r}")
    if p.seed is not None and (not _is_int(p.seed) or not 0 <= p.seed < limits.UINT64_LIMIT):
        add("seed", f"must be an integer in [0, 2**64), got {p.seed!r}")
    max_ok = p.max_tokens is None or (_is_int(p.max_tokens) and p.max_tokens >= 1)
    if not max_ok:
        add("max_tokens", f"must be at least 1, got {p.max_tokens!r}")
    if not _is_int(p.min_tokens) or not 0 <= p.min_tokens <= limits.INT32_MAX:
        add("min_tokens", f"must be in [0, 2**31), got {p.min_tokens!r}")
    elif max_ok and p.max_tokens is not None and p.min_tokens > p.max_tokens:
        add("min_tokens", f"must be <= max_tokens ({p.max_tokens}), got {p.min_tokens}")
    _check_stops(add, stop, p.stop_token_ids)
    for name, value in (("presence_penalty", p.presence_penalty), ("frequency_penalty", p.frequency_penalty)):
        if not _is_finite(value) or not -limits.PENALTY_BOUND <= value <= limits.PENALTY_BOUND:
            add(name, f"must be in [-2, 2], got {value!r}")
    if not _is_finite(p.repetition_penalty) or p.repetition_penalty <= 0:
        add("repetition_penalty", f"must be a finite number > 0, got {p.repetition_penalty!r}")
    _check_logit_bias(add, p.logit_bias, vocab_size)
    _check_token_filters(add, p.allowed_token_ids, p.bad_words_token_ids, vocab_size)
    if p.structured_outputs is not None:
        _check_structured_outputs(add, p.structured_outputs)
    for name, top in (("logprobs", p.logprobs), ("prompt_logprobs", p.prompt_logprobs)):
        if top is not None and (not _is_int(top) or not 0 <= top <= limits.MAX_LOGPROBS):
            add(name, f"must be in [0, {limits.MAX_LOGPROBS}], got {top!r}")
    if not _is_int(n) or not 1 <= n <= limits.MAX_N:
        add("n", f"must be in [1, {limits.MAX_N}], got {n!r}")
    return bad


def _check_stops(add: Callable[[str, str], None], stops: Sequence[str], stop_ids: Sequence[int]) -> None:
    if len(stops) > limits.MAX_STOP_STRINGS:
        add("stop", f"at most {limits.MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
    elif not all(isinstance(s, str) for s in stops):
        add("stop", "every stop string must be a string")
    elif any(s == "" for s in stops):
        add("stop", "stop strings must not be empty")
    elif any(len(s) > limits.MAX_STOP_STRING_CHARS for s in stops):
        add("stop", f"a stop string may have at most {limits.MAX_STOP_STRING_CHARS} characters, "
                    f"got {max(len(s) for s in stops)}")
    if len(stop_ids) > limits.MAX_TOKEN_IDS:
        add("stop_token_ids", f"at most {limits.MAX_TOKEN_IDS} stop token ids are allowed, got {len(stop_ids)}")
    elif not all(_is_int(t) and 0 <= t <= limits.INT32_MAX for t in stop_ids):
        add("stop_token_ids", "stop token ids must be integers in [0, 2**31)")


def _check_logit_bias(add: Callable[[str, str], None], bias: dict[int, float], vocab_size: int | None) -> None:
    if len(bias) > limits.MAX_LOGIT_BIAS:
        add("logit_bias", f"at most {limits.MAX_LOGIT_BIAS} entries are allowed, got {len(bias)}")
        return
    id_bound = vocab_size if vocab_size is not None else limits.INT32_MAX + 1
    bad_id = next((t for t in bias if not (_is_int(t) and 0 <= t < id_bound)), None)
    if bad_id is not None:
        add("logit_bias", f"token id {bad_id!r} is outside the vocabulary [0, {id_bound})")
    elif not all(_is_finite(b) and -limits.LOGIT_BIAS_BOUND <= b <= limits.LOGIT_BIAS_BOUND for b in bias.values()):
        add("logit_bias", "every bias must be a number in [-100, 100]")


def _check_token_filters(add: Callable[[str, str], None], allowed: Sequence[int],
                         bad_sequences: Sequence[Sequence[int]], vocab_size: int | None) -> None:
    id_bound = vocab_size if vocab_size is not None else limits.INT32_MAX + 1

    def in_vocab(ids: Sequence[int]) -> bool:
        return all(_is_int(t) and 0 <= t < id_bound for t in ids)

    if len(allowed) > limits.MAX_ALLOWED_TOKEN_IDS:
        add("allowed_token_ids", f"at most {limits.MAX_ALLOWED_TOKEN_IDS} ids are allowed, got {len(allowed)}")
    elif not in_vocab(allowed):
        add("allowed_token_ids", f"every id must be in the vocabulary [0, {id_bound})")
    if len(bad_sequences) > limits.MAX_BAD_WORDS:
        add("bad_words", f"at most {limits.MAX_BAD_WORDS} bad-word token sequences are allowed, got "
                         f"{len(bad_sequences)}")
    elif not all(isinstance(ids, list) and 0 < len(ids) <= limits.MAX_TOKEN_IDS and in_vocab(ids)
                 for ids in bad_sequences):
        add("bad_words", f"every bad word must be 1 to {limits.MAX_TOKEN_IDS} token ids in the vocabulary "
                         f"[0, {id_bound})")


def _check_bad_words(bad: list[FieldViolation], words: Sequence[str]) -> None:
    """The text form of bad_words (the frontend's; the engine sees only their token ids)."""
    if len(words) > limits.MAX_BAD_WORDS:
        bad.append(FieldViolation("bad_words", f"at most {limits.MAX_BAD_WORDS} bad words are allowed, "
                                               f"got {len(words)}"))
    elif not all(isinstance(w, str) and 0 < len(w) <= limits.MAX_STOP_STRING_CHARS for w in words):
        bad.append(FieldViolation("bad_words", f"every bad word must be a non-empty string of at most "
                                               f"{limits.MAX_STOP_STRING_CHARS} characters"))


def _check_structured_outputs(add: Callable[[str, str], None], so: StructuredOutputs) -> None:
    """Exactly one constraint, within the size bounds. Whether it compiles is the engine's question."""
    kinds = so.kinds()
    if len(kinds) != 1:
        add("structured_outputs", f"exactly one of {', '.join(STRUCTURED_KINDS)} must be set, got "
                                  f"{', '.join(kinds) or 'none'}")
        return
    if so.choice is not None:
        if not so.choice:
            add("structured_outputs.choice", "must hold at least one choice")
            return
        if len(so.choice) > limits.MAX_CHOICES:
            add("structured_outputs.choice", f"at most {limits.MAX_CHOICES} choices are allowed, "
                                             f"got {len(so.choice)}")
            return
        if not all(isinstance(c, str) and c for c in so.choice):
            add("structured_outputs.choice", "every choice must be a non-empty string")
            return
    size = so.spec_bytes()
    if size > limits.MAX_STRUCTURED_OUTPUT_BYTES:
        add(f"structured_outputs.{kinds[0]}", f"must be at most {limits.MAX_STRUCTURED_OUTPUT_BYTES} bytes, "
                                               f"got more")
        return
    problem = _compile_cost_problem(so)
    if problem is not None:
        add(f"structured_outputs.{kinds[0]}", f"would cost too much to compile: {problem} "
                                               "(docs/security.md, structured outputs)")


def _compile_cost_problem(so: StructuredOutputs) -> str | None:
    """The bound (shared_runtime/grammar_bounds.py) a constraint breaks, before anything compiles it."""
    if so.json is not None:
        return grammar_bounds.json_schema_problem(so.json)
    if so.structural_tag is not None:
        return grammar_bounds.structural_tag_problem(so.structural_tag)
    text = so.regex if so.regex is not None else so.grammar
    return grammar_bounds.regex_problem(text) if text is not None else None


def _clamped(bias: float) -> float:
    """A finite bias clamped to [-100, 100] (as vLLM does); anything else is left for `violations`."""
    if not _is_finite(bias):
        return bias
    return min(limits.LOGIT_BIAS_BOUND, max(-limits.LOGIT_BIAS_BOUND, bias))


def _is_int(value: object) -> bool:
    """An integral number that is not a bool (plain ints answered without the ABC check, which the
    sampling rules would pay for a dozen values per request, twice)."""
    if type(value) is int:
        return True
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    """A finite real number that is not a bool (plain floats and ints answered without the ABC check)."""
    kind = type(value)
    if kind is float or kind is int:
        return math.isfinite(value)  # type: ignore[arg-type]
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


class LoRARequest(msgspec.Struct, frozen=True):
    """vLLM's `LoRARequest`: which adapter a request runs under. The name selects a served adapter
    (--lora-modules, or loaded at run time); offline, a `lora_path` the engine does not serve under that
    name yet is loaded first, as vLLM does. `lora_int_id` is accepted for vLLM compatibility: without a
    path it must match the served adapter's id when given (the engine numbers adapters itself)."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""
class KvTransferParams(msgspec.Struct, kw_only=True, gc=False):
    """Prefill/decode disaggregation (vLLM's kv_transfer_params): on a request, what its engine does with
    its K/V (keep it for a consumer: `do_remote_decode`; pull it: `do_remote_prefill` from `remote_*`); on a
    producer's last output, where the kept blocks are (tandem.engine.v1.KvTransferParams documents each)."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str = ""
    remote_host: str = ""
    remote_port: int = 0
    remote_request_id: str = ""
    remote_block_ids: list[int] = msgspec.field(default_factory=list)
    remote_num_tokens: int = 0


class EngineCoreRequest(msgspec.Struct, kw_only=True):
    """One request to the engine: token ids in, token ids out. n is always 1 here."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: EngineSamplingParams
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    arrival_time: float = 0.0
    priority: int = 0
    trace_headers: dict[str, str] = msgspec.field(default_factory=dict)
    # A continuation's tokens generated so far (elsewhere): output, not prompt (the proto says how).
    output_token_ids: list[int] = msgspec.field(default_factory=list)
    # The LoRA adapter (a name of the engine's --lora-modules) to run under; "" = the base model.
    lora_name: str = ""
    kv_transfer_params: KvTransferParams | None = None  # P/D disaggregation; None for an ordinary request


# ---- outputs -----------------------------------------------------------------------------------------


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
    kv_transfer_params: KvTransferParams | None = None  # a producer's kept blocks (last output only)

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
    # Speculative decoding, cumulative: verifications (a request's drafts in one step), drafts verified,
    # drafts accepted, and accepted drafts by their position in the run (index 0 = the first draft).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)
    num_scheduled_tokens: int = 0  # this step
    num_prompt_tokens: int = 0  # this step: prompt tokens computed
    num_generation_tokens: int = 0  # this step: tokens sampled
    # With LoRA: requests running / waiting per adapter name (vLLM's; base-model requests not counted).
    running_lora_adapters: dict[str, int] = msgspec.field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = msgspec.field(default_factory=dict)


class EngineCoreOutputs(msgspec.Struct, kw_only=True, gc=False):
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
