from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Modality(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODALITY_UNSPECIFIED: _ClassVar[Modality]
    MODALITY_IMAGE: _ClassVar[Modality]
    MODALITY_VIDEO: _ClassVar[Modality]
    MODALITY_AUDIO: _ClassVar[Modality]
MODALITY_UNSPECIFIED: Modality
MODALITY_IMAGE: Modality
MODALITY_VIDEO: Modality
MODALITY_AUDIO: Modality

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "text", "token_ids", "temperature", "sampling", "decoding", "stopping", "response", "kv", "truncate_prompt_tokens", "priority", "session_id", "media", "lora_name")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    text: str
    token_ids: TokenIds
    temperature: float
    sampling: RandomSampling
    decoding: DecodingParameters
    stopping: StoppingCriteria
    response: ResponseOptions
    kv: KVCacheParameters
    truncate_prompt_tokens: int
    priority: int
    session_id: str
    media: _containers.RepeatedCompositeFieldContainer[MediaItem]
    lora_name: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., temperature: _Optional[float] = ..., sampling: _Optional[_Union[RandomSampling, _Mapping]] = ..., decoding: _Optional[_Union[DecodingParameters, _Mapping]] = ..., stopping: _Optional[_Union[StoppingCriteria, _Mapping]] = ..., response: _Optional[_Union[ResponseOptions, _Mapping]] = ..., kv: _Optional[_Union[KVCacheParameters, _Mapping]] = ..., truncate_prompt_tokens: _Optional[int] = ..., priority: _Optional[int] = ..., session_id: _Optional[str] = ..., media: _Optional[_Iterable[_Union[MediaItem, _Mapping]]] = ..., lora_name: _Optional[str] = ...) -> None: ...

class RandomSampling(_message.Message):
    __slots__ = ("num_sequences", "top_k", "top_p", "min_p", "seed")
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    num_sequences: int
    top_k: int
    top_p: float
    min_p: float
    seed: int
    def __init__(self, num_sequences: _Optional[int] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class DecodingParameters(_message.Message):
    __slots__ = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids", "json", "regex", "choice", "grammar", "json_object", "structural_tag")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    class StringChoices(_message.Message):
        __slots__ = ("choices",)
        CHOICES_FIELD_NUMBER: _ClassVar[int]
        choices: _containers.RepeatedScalarFieldContainer[str]
        def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    json: str
    regex: str
    choice: DecodingParameters.StringChoices
    grammar: str
    json_object: bool
    structural_tag: str
    def __init__(self, presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., json: _Optional[str] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[DecodingParameters.StringChoices, _Mapping]] = ..., grammar: _Optional[str] = ..., json_object: _Optional[bool] = ..., structural_tag: _Optional[str] = ...) -> None: ...

class StoppingCriteria(_message.Message):
    __slots__ = ("max_new_tokens", "min_new_tokens", "stop_token_ids", "stop_strings", "include_stop_strings", "ignore_eos")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    min_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    include_stop_strings: bool
    ignore_eos: bool
    def __init__(self, max_new_tokens: _Optional[int] = ..., min_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop_strings: _Optional[_Iterable[str]] = ..., include_stop_strings: _Optional[bool] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class ResponseOptions(_message.Message):
    __slots__ = ("prompt_token_ids", "prompt_logprobs", "prompt_candidates", "output_text", "output_token_ids", "output_logprobs", "output_candidates", "skip_special_tokens")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TEXT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: bool
    prompt_logprobs: bool
    prompt_candidates: CandidateTokens
    output_text: bool
    output_token_ids: bool
    output_logprobs: bool
    output_candidates: CandidateTokens
    skip_special_tokens: bool
    def __init__(self, prompt_token_ids: _Optional[bool] = ..., prompt_logprobs: _Optional[bool] = ..., prompt_candidates: _Optional[_Union[CandidateTokens, _Mapping]] = ..., output_text: _Optional[bool] = ..., output_token_ids: _Optional[bool] = ..., output_logprobs: _Optional[bool] = ..., output_candidates: _Optional[_Union[CandidateTokens, _Mapping]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class KVCacheParameters(_message.Message):
    __slots__ = ("bypass_prefix_cache", "cache_salt", "kv_transfer_params", "ec_transfer_params")
    BYPASS_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    EC_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    bypass_prefix_cache: bool
    cache_salt: str
    kv_transfer_params: _struct_pb2.Struct
    ec_transfer_params: _struct_pb2.Struct
    def __init__(self, bypass_prefix_cache: _Optional[bool] = ..., cache_salt: _Optional[str] = ..., kv_transfer_params: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., ec_transfer_params: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class CandidateTokens(_message.Message):
    __slots__ = ("top_n", "token_ids", "all")
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    top_n: int
    token_ids: TokenIds
    all: bool
    def __init__(self, top_n: _Optional[int] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., all: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("prompt_info", "outputs")
    PROMPT_INFO_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    prompt_info: PromptInfo
    outputs: SequenceOutput
    def __init__(self, prompt_info: _Optional[_Union[PromptInfo, _Mapping]] = ..., outputs: _Optional[_Union[SequenceOutput, _Mapping]] = ...) -> None: ...

class SequenceOutput(_message.Message):
    __slots__ = ("index", "text", "num_tokens", "token_ids", "logprobs", "ranks", "candidate_tokens", "finish_info")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_INFO_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    num_tokens: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    candidate_tokens: _containers.RepeatedCompositeFieldContainer[CandidateTokenInfo]
    finish_info: FinishInfo
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., num_tokens: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., ranks: _Optional[_Iterable[int]] = ..., candidate_tokens: _Optional[_Iterable[_Union[CandidateTokenInfo, _Mapping]]] = ..., finish_info: _Optional[_Union[FinishInfo, _Mapping]] = ...) -> None: ...

class PromptInfo(_message.Message):
    __slots__ = ("num_prompt_tokens", "token_ids", "logprobs", "ranks", "candidate_tokens")
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_prompt_tokens: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    candidate_tokens: _containers.RepeatedCompositeFieldContainer[CandidateTokenInfo]
    def __init__(self, num_prompt_tokens: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., ranks: _Optional[_Iterable[int]] = ..., candidate_tokens: _Optional[_Iterable[_Union[CandidateTokenInfo, _Mapping]]] = ...) -> None: ...

class FinishInfo(_message.Message):
    __slots__ = ("num_output_tokens", "finish_reason", "stop_token_id", "eos_token_id", "stop_string", "kv_transfer_params", "ec_transfer_params")
    class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        NOT_FINISHED: _ClassVar[FinishInfo.FinishReason]
        LENGTH: _ClassVar[FinishInfo.FinishReason]
        STOP: _ClassVar[FinishInfo.FinishReason]
        ABORTED: _ClassVar[FinishInfo.FinishReason]
    NOT_FINISHED: FinishInfo.FinishReason
    LENGTH: FinishInfo.FinishReason
    STOP: FinishInfo.FinishReason
    ABORTED: FinishInfo.FinishReason
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    EC_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    num_output_tokens: int
    finish_reason: FinishInfo.FinishReason
    stop_token_id: int
    eos_token_id: int
    stop_string: str
    kv_transfer_params: _struct_pb2.Struct
    ec_transfer_params: _struct_pb2.Struct
    def __init__(self, num_output_tokens: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishInfo.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., eos_token_id: _Optional[int] = ..., stop_string: _Optional[str] = ..., kv_transfer_params: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., ec_transfer_params: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class CandidateTokenInfo(_message.Message):
    __slots__ = ("tokens",)
    class TokenInfo(_message.Message):
        __slots__ = ("id", "logprob", "rank")
        ID_FIELD_NUMBER: _ClassVar[int]
        LOGPROB_FIELD_NUMBER: _ClassVar[int]
        RANK_FIELD_NUMBER: _ClassVar[int]
        id: int
        logprob: float
        rank: int
        def __init__(self, id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ...) -> None: ...
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[CandidateTokenInfo.TokenInfo]
    def __init__(self, tokens: _Optional[_Iterable[_Union[CandidateTokenInfo.TokenInfo, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class MediaItem(_message.Message):
    __slots__ = ("modality", "url", "data_uri", "raw_bytes", "features", "mime_type", "uuid")
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    DATA_URI_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    modality: Modality
    url: str
    data_uri: str
    raw_bytes: bytes
    features: PreprocessedMediaFeatures
    mime_type: str
    uuid: str
    def __init__(self, modality: _Optional[_Union[Modality, str]] = ..., url: _Optional[str] = ..., data_uri: _Optional[str] = ..., raw_bytes: _Optional[bytes] = ..., features: _Optional[_Union[PreprocessedMediaFeatures, _Mapping]] = ..., mime_type: _Optional[str] = ..., uuid: _Optional[str] = ...) -> None: ...

class PreprocessedMediaFeatures(_message.Message):
    __slots__ = ("kwargs", "identifier", "offset", "length", "mm_hash", "is_embed")
    KWARGS_FIELD_NUMBER: _ClassVar[int]
    IDENTIFIER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    MM_HASH_FIELD_NUMBER: _ClassVar[int]
    IS_EMBED_FIELD_NUMBER: _ClassVar[int]
    kwargs: bytes
    identifier: str
    offset: int
    length: int
    mm_hash: str
    is_embed: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, kwargs: _Optional[bytes] = ..., identifier: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., mm_hash: _Optional[str] = ..., is_embed: _Optional[_Iterable[bool]] = ...) -> None: ...
