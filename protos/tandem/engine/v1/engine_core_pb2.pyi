from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class RequestEventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REQUEST_EVENT_TYPE_UNSPECIFIED: _ClassVar[RequestEventType]
    REQUEST_EVENT_TYPE_QUEUED: _ClassVar[RequestEventType]
    REQUEST_EVENT_TYPE_SCHEDULED: _ClassVar[RequestEventType]
    REQUEST_EVENT_TYPE_PREEMPTED: _ClassVar[RequestEventType]
    REQUEST_EVENT_TYPE_FIRST_TOKEN: _ClassVar[RequestEventType]
    REQUEST_EVENT_TYPE_FINISHED: _ClassVar[RequestEventType]

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_UNSPECIFIED: _ClassVar[ErrorCode]
    ERROR_CODE_INVALID_ARGUMENT: _ClassVar[ErrorCode]
    ERROR_CODE_RESOURCE_EXHAUSTED: _ClassVar[ErrorCode]
    ERROR_CODE_INTERNAL: _ClassVar[ErrorCode]
    ERROR_CODE_UNAVAILABLE: _ClassVar[ErrorCode]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason
REQUEST_EVENT_TYPE_UNSPECIFIED: RequestEventType
REQUEST_EVENT_TYPE_QUEUED: RequestEventType
REQUEST_EVENT_TYPE_SCHEDULED: RequestEventType
REQUEST_EVENT_TYPE_PREEMPTED: RequestEventType
REQUEST_EVENT_TYPE_FIRST_TOKEN: RequestEventType
REQUEST_EVENT_TYPE_FINISHED: RequestEventType
ERROR_CODE_UNSPECIFIED: ErrorCode
ERROR_CODE_INVALID_ARGUMENT: ErrorCode
ERROR_CODE_RESOURCE_EXHAUSTED: ErrorCode
ERROR_CODE_INTERNAL: ErrorCode
ERROR_CODE_UNAVAILABLE: ErrorCode

class LoraAdapterInfo(_message.Message):
    __slots__ = ("lora_name", "lora_id", "fingerprint")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_id: int
    fingerprint: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_id: _Optional[int] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class WatchLoraAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoraAdapterSet(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapterInfo]
    def __init__(self, adapters: _Optional[_Iterable[_Union[LoraAdapterInfo, _Mapping]]] = ...) -> None: ...

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path", "load_inplace")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    LOAD_INPLACE_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    load_inplace: bool
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ..., load_inplace: _Optional[bool] = ...) -> None: ...

class LoadLoraAdapterResponse(_message.Message):
    __slots__ = ("lora_name", "lora_id", "lora_adapters", "lora_adapter_infos")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTER_INFOS_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_id: int
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    lora_adapter_infos: _containers.RepeatedCompositeFieldContainer[LoraAdapterInfo]
    def __init__(self, lora_name: _Optional[str] = ..., lora_id: _Optional[int] = ..., lora_adapters: _Optional[_Iterable[str]] = ..., lora_adapter_infos: _Optional[_Iterable[_Union[LoraAdapterInfo, _Mapping]]] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class UnloadLoraAdapterResponse(_message.Message):
    __slots__ = ("lora_name", "lora_id", "lora_adapters", "lora_adapter_infos")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTER_INFOS_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_id: int
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    lora_adapter_infos: _containers.RepeatedCompositeFieldContainer[LoraAdapterInfo]
    def __init__(self, lora_name: _Optional[str] = ..., lora_id: _Optional[int] = ..., lora_adapters: _Optional[_Iterable[str]] = ..., lora_adapter_infos: _Optional[_Iterable[_Union[LoraAdapterInfo, _Mapping]]] = ...) -> None: ...

class EngineCoreInput(_message.Message):
    __slots__ = ("add", "abort")
    ADD_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    add: EngineCoreRequest
    abort: AbortRequests
    def __init__(self, add: _Optional[_Union[EngineCoreRequest, _Mapping]] = ..., abort: _Optional[_Union[AbortRequests, _Mapping]] = ...) -> None: ...

class EngineCoreRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "eos_token_ids", "arrival_time", "priority", "trace_headers", "output_token_ids", "lora_name", "kv_transfer_params")
    class TraceHeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_TIME_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TRACE_HEADERS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: EngineSamplingParams
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    arrival_time: float
    priority: int
    trace_headers: _containers.ScalarMap[str, str]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    lora_name: str
    kv_transfer_params: KvTransferParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[EngineSamplingParams, _Mapping]] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., arrival_time: _Optional[float] = ..., priority: _Optional[int] = ..., trace_headers: _Optional[_Mapping[str, str]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., lora_name: _Optional[str] = ..., kv_transfer_params: _Optional[_Union[KvTransferParams, _Mapping]] = ...) -> None: ...

class KvTransferParams(_message.Message):
    __slots__ = ("do_remote_decode", "do_remote_prefill", "remote_engine_id", "remote_host", "remote_port", "remote_request_id", "remote_block_ids", "remote_num_tokens")
    DO_REMOTE_DECODE_FIELD_NUMBER: _ClassVar[int]
    DO_REMOTE_PREFILL_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_HOST_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PORT_FIELD_NUMBER: _ClassVar[int]
    REMOTE_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    do_remote_decode: bool
    do_remote_prefill: bool
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_request_id: str
    remote_block_ids: _containers.RepeatedScalarFieldContainer[int]
    remote_num_tokens: int
    def __init__(self, do_remote_decode: _Optional[bool] = ..., do_remote_prefill: _Optional[bool] = ..., remote_engine_id: _Optional[str] = ..., remote_host: _Optional[str] = ..., remote_port: _Optional[int] = ..., remote_request_id: _Optional[str] = ..., remote_block_ids: _Optional[_Iterable[int]] = ..., remote_num_tokens: _Optional[int] = ...) -> None: ...

class EngineSamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "prompt_logprobs", "logit_bias", "structured_outputs", "allowed_token_ids", "bad_words_token_ids")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    max_tokens: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logprobs: int
    prompt_logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    structured_outputs: StructuredOutputs
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words_token_ids: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., structured_outputs: _Optional[_Union[StructuredOutputs, _Mapping]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words_token_ids: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ...) -> None: ...

class StructuredOutputs(_message.Message):
    __slots__ = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
    JSON_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    json: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    structural_tag: str
    def __init__(self, json: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ..., structural_tag: _Optional[str] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AbortRequests(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class EngineCoreOutputs(_message.Message):
    __slots__ = ("outputs", "scheduler_stats", "timestamp")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_STATS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[EngineCoreOutput]
    scheduler_stats: SchedulerStats
    timestamp: float
    def __init__(self, outputs: _Optional[_Iterable[_Union[EngineCoreOutput, _Mapping]]] = ..., scheduler_stats: _Optional[_Union[SchedulerStats, _Mapping]] = ..., timestamp: _Optional[float] = ...) -> None: ...

class EngineCoreOutput(_message.Message):
    __slots__ = ("request_id", "new_token_ids", "new_logprobs", "prompt_logprobs", "finish_reason", "stop_token_id", "num_cached_tokens", "events", "error", "kv_transfer_params")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    new_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    finish_reason: FinishReason
    stop_token_id: int
    num_cached_tokens: int
    events: _containers.RepeatedCompositeFieldContainer[RequestEvent]
    error: EngineError
    kv_transfer_params: KvTransferParams
    def __init__(self, request_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., new_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., events: _Optional[_Iterable[_Union[RequestEvent, _Mapping]]] = ..., error: _Optional[_Union[EngineError, _Mapping]] = ..., kv_transfer_params: _Optional[_Union[KvTransferParams, _Mapping]] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class RequestEvent(_message.Message):
    __slots__ = ("type", "timestamp")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    type: RequestEventType
    timestamp: float
    def __init__(self, type: _Optional[_Union[RequestEventType, str]] = ..., timestamp: _Optional[float] = ...) -> None: ...

class EngineError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: ErrorCode
    message: str
    def __init__(self, code: _Optional[_Union[ErrorCode, str]] = ..., message: _Optional[str] = ...) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("num_running", "num_waiting", "kv_cache_usage", "num_free_blocks", "num_total_blocks", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "num_scheduled_tokens", "num_prompt_tokens", "num_generation_tokens", "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos", "running_lora_adapters", "waiting_lora_adapters")
    class RunningLoraAdaptersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class WaitingLoraAdaptersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    WAITING_LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_scheduled_tokens: int
    num_prompt_tokens: int
    num_generation_tokens: int
    spec_decode_num_drafts: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    spec_decode_num_accepted_tokens_per_pos: _containers.RepeatedScalarFieldContainer[int]
    running_lora_adapters: _containers.ScalarMap[str, int]
    waiting_lora_adapters: _containers.ScalarMap[str, int]
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., num_generation_tokens: _Optional[int] = ..., spec_decode_num_drafts: _Optional[int] = ..., spec_decode_num_draft_tokens: _Optional[int] = ..., spec_decode_num_accepted_tokens: _Optional[int] = ..., spec_decode_num_accepted_tokens_per_pos: _Optional[_Iterable[int]] = ..., running_lora_adapters: _Optional[_Mapping[str, int]] = ..., waiting_lora_adapters: _Optional[_Mapping[str, int]] = ...) -> None: ...

class GetEngineInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("model_name", "max_model_len", "vocab_size", "block_size", "num_blocks", "tensor_parallel_size", "dtype", "enable_prefix_caching", "max_num_seqs", "max_num_batched_tokens", "scheduling_policy", "device", "engine_id", "eos_token_ids", "tokenizer_sha256", "kv_cache_events", "lora_adapters", "kv_role", "pipeline_parallel_size", "lora_adapter_infos")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ENABLE_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULING_POLICY_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_SHA256_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_EVENTS_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    KV_ROLE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTER_INFOS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_blocks: int
    tensor_parallel_size: int
    dtype: str
    enable_prefix_caching: bool
    max_num_seqs: int
    max_num_batched_tokens: int
    scheduling_policy: str
    device: str
    engine_id: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tokenizer_sha256: str
    kv_cache_events: bool
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    kv_role: str
    pipeline_parallel_size: int
    lora_adapter_infos: _containers.RepeatedCompositeFieldContainer[LoraAdapterInfo]
    def __init__(self, model_name: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., dtype: _Optional[str] = ..., enable_prefix_caching: _Optional[bool] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., scheduling_policy: _Optional[str] = ..., device: _Optional[str] = ..., engine_id: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., tokenizer_sha256: _Optional[str] = ..., kv_cache_events: _Optional[bool] = ..., lora_adapters: _Optional[_Iterable[str]] = ..., kv_role: _Optional[str] = ..., pipeline_parallel_size: _Optional[int] = ..., lora_adapter_infos: _Optional[_Iterable[_Union[LoraAdapterInfo, _Mapping]]] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineLoad(_message.Message):
    __slots__ = ("num_running", "num_waiting", "kv_cache_usage", "num_free_blocks", "num_total_blocks", "prefix_cache_queries", "prefix_cache_hits")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ...) -> None: ...

class SubscribeKvEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("sequence_number", "timestamp", "events", "snapshot", "scheduler_stats", "engine_id")
    SEQUENCE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_STATS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    sequence_number: int
    timestamp: float
    events: _containers.RepeatedCompositeFieldContainer[KvCacheEvent]
    snapshot: KvSnapshotChunk
    scheduler_stats: SchedulerStats
    engine_id: str
    def __init__(self, sequence_number: _Optional[int] = ..., timestamp: _Optional[float] = ..., events: _Optional[_Iterable[_Union[KvCacheEvent, _Mapping]]] = ..., snapshot: _Optional[_Union[KvSnapshotChunk, _Mapping]] = ..., scheduler_stats: _Optional[_Union[SchedulerStats, _Mapping]] = ..., engine_id: _Optional[str] = ...) -> None: ...

class KvSnapshotChunk(_message.Message):
    __slots__ = ("index", "count", "num_blocks")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    index: int
    count: int
    num_blocks: int
    def __init__(self, index: _Optional[int] = ..., count: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class KvCacheEvent(_message.Message):
    __slots__ = ("stored", "removed", "cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: KvBlocksStored
    removed: KvBlocksRemoved
    cleared: KvCacheCleared
    def __init__(self, stored: _Optional[_Union[KvBlocksStored, _Mapping]] = ..., removed: _Optional[_Union[KvBlocksRemoved, _Mapping]] = ..., cleared: _Optional[_Union[KvCacheCleared, _Mapping]] = ...) -> None: ...

class KvBlocksStored(_message.Message):
    __slots__ = ("blocks", "parent_block_hash", "block_size", "lora_name", "lora_id", "lora_fingerprint")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[KvBlock]
    parent_block_hash: bytes
    block_size: int
    lora_name: str
    lora_id: int
    lora_fingerprint: str
    def __init__(self, blocks: _Optional[_Iterable[_Union[KvBlock, _Mapping]]] = ..., parent_block_hash: _Optional[bytes] = ..., block_size: _Optional[int] = ..., lora_name: _Optional[str] = ..., lora_id: _Optional[int] = ..., lora_fingerprint: _Optional[str] = ...) -> None: ...

class KvBlock(_message.Message):
    __slots__ = ("block_hash", "token_ids")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class KvBlocksRemoved(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class KvCacheCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetTokenizerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizerChunk(_message.Message):
    __slots__ = ("data", "sha256", "total_size", "model_name")
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    sha256: str
    total_size: int
    model_name: str
    def __init__(self, data: _Optional[bytes] = ..., sha256: _Optional[str] = ..., total_size: _Optional[int] = ..., model_name: _Optional[str] = ...) -> None: ...

class KvCacheLayout(_message.Message):
    __slots__ = ("model_name", "block_size", "dtype", "num_layers", "block_shape", "tensor_parallel_size", "num_kv_heads")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SHAPE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    block_size: int
    dtype: str
    num_layers: int
    block_shape: _containers.RepeatedScalarFieldContainer[int]
    tensor_parallel_size: int
    num_kv_heads: int
    def __init__(self, model_name: _Optional[str] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., block_shape: _Optional[_Iterable[int]] = ..., tensor_parallel_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ...) -> None: ...

class PullKvBlocksRequest(_message.Message):
    __slots__ = ("request_id", "first_block", "layout", "lora_name", "accept_side_channel")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_SIDE_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_block: int
    layout: KvCacheLayout
    lora_name: str
    accept_side_channel: bool
    def __init__(self, request_id: _Optional[str] = ..., first_block: _Optional[int] = ..., layout: _Optional[_Union[KvCacheLayout, _Mapping]] = ..., lora_name: _Optional[str] = ..., accept_side_channel: _Optional[bool] = ...) -> None: ...

class KvBlocksChunk(_message.Message):
    __slots__ = ("data", "num_blocks", "num_tokens", "checksum_span_bytes", "span_crc32", "side_port", "side_ticket")
    DATA_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_SPAN_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPAN_CRC32_FIELD_NUMBER: _ClassVar[int]
    SIDE_PORT_FIELD_NUMBER: _ClassVar[int]
    SIDE_TICKET_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    num_blocks: int
    num_tokens: int
    checksum_span_bytes: int
    span_crc32: _containers.RepeatedScalarFieldContainer[int]
    side_port: int
    side_ticket: bytes
    def __init__(self, data: _Optional[bytes] = ..., num_blocks: _Optional[int] = ..., num_tokens: _Optional[int] = ..., checksum_span_bytes: _Optional[int] = ..., span_crc32: _Optional[_Iterable[int]] = ..., side_port: _Optional[int] = ..., side_ticket: _Optional[bytes] = ...) -> None: ...
