from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PEScaling(_message.Message):
    __slots__ = ("none", "linear", "ntk", "dynamic", "yarn", "llama3", "longrope")
    NONE_FIELD_NUMBER: _ClassVar[int]
    LINEAR_FIELD_NUMBER: _ClassVar[int]
    NTK_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_FIELD_NUMBER: _ClassVar[int]
    YARN_FIELD_NUMBER: _ClassVar[int]
    LLAMA3_FIELD_NUMBER: _ClassVar[int]
    LONGROPE_FIELD_NUMBER: _ClassVar[int]
    none: NoScaling
    linear: LinearScaling
    ntk: NTKScaling
    dynamic: DynamicScaling
    yarn: YarnScaling
    llama3: Llama3Scaling
    longrope: LongRopeScaling
    def __init__(self, none: _Optional[_Union[NoScaling, _Mapping]] = ..., linear: _Optional[_Union[LinearScaling, _Mapping]] = ..., ntk: _Optional[_Union[NTKScaling, _Mapping]] = ..., dynamic: _Optional[_Union[DynamicScaling, _Mapping]] = ..., yarn: _Optional[_Union[YarnScaling, _Mapping]] = ..., llama3: _Optional[_Union[Llama3Scaling, _Mapping]] = ..., longrope: _Optional[_Union[LongRopeScaling, _Mapping]] = ...) -> None: ...

class NoScaling(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LinearScaling(_message.Message):
    __slots__ = ("factor",)
    FACTOR_FIELD_NUMBER: _ClassVar[int]
    factor: float
    def __init__(self, factor: _Optional[float] = ...) -> None: ...

class NTKScaling(_message.Message):
    __slots__ = ("factor",)
    FACTOR_FIELD_NUMBER: _ClassVar[int]
    factor: float
    def __init__(self, factor: _Optional[float] = ...) -> None: ...

class DynamicScaling(_message.Message):
    __slots__ = ("factor", "original_max_position_embeddings", "dynamic_mode")
    FACTOR_FIELD_NUMBER: _ClassVar[int]
    ORIGINAL_MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_MODE_FIELD_NUMBER: _ClassVar[int]
    factor: float
    original_max_position_embeddings: int
    dynamic_mode: str
    def __init__(self, factor: _Optional[float] = ..., original_max_position_embeddings: _Optional[int] = ..., dynamic_mode: _Optional[str] = ...) -> None: ...

class YarnScaling(_message.Message):
    __slots__ = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")
    FACTOR_FIELD_NUMBER: _ClassVar[int]
    ORIGINAL_MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    BETA_FAST_FIELD_NUMBER: _ClassVar[int]
    BETA_SLOW_FIELD_NUMBER: _ClassVar[int]
    MSCALE_FIELD_NUMBER: _ClassVar[int]
    MSCALE_ALL_DIM_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FACTOR_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float
    attention_factor: float
    truncate: bool
    def __init__(self, factor: _Optional[float] = ..., original_max_position_embeddings: _Optional[int] = ..., beta_fast: _Optional[float] = ..., beta_slow: _Optional[float] = ..., mscale: _Optional[float] = ..., mscale_all_dim: _Optional[float] = ..., attention_factor: _Optional[float] = ..., truncate: _Optional[bool] = ...) -> None: ...

class Llama3Scaling(_message.Message):
    __slots__ = ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor")
    FACTOR_FIELD_NUMBER: _ClassVar[int]
    ORIGINAL_MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    LOW_FREQ_FACTOR_FIELD_NUMBER: _ClassVar[int]
    HIGH_FREQ_FACTOR_FIELD_NUMBER: _ClassVar[int]
    factor: float
    original_max_position_embeddings: int
    low_freq_factor: float
    high_freq_factor: float
    def __init__(self, factor: _Optional[float] = ..., original_max_position_embeddings: _Optional[int] = ..., low_freq_factor: _Optional[float] = ..., high_freq_factor: _Optional[float] = ...) -> None: ...

class LongRopeScaling(_message.Message):
    __slots__ = ("short_factor", "long_factor", "original_max_position_embeddings", "factor", "attention_factor")
    SHORT_FACTOR_FIELD_NUMBER: _ClassVar[int]
    LONG_FACTOR_FIELD_NUMBER: _ClassVar[int]
    ORIGINAL_MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    FACTOR_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FACTOR_FIELD_NUMBER: _ClassVar[int]
    short_factor: _containers.RepeatedScalarFieldContainer[float]
    long_factor: _containers.RepeatedScalarFieldContainer[float]
    original_max_position_embeddings: int
    factor: float
    attention_factor: float
    def __init__(self, short_factor: _Optional[_Iterable[float]] = ..., long_factor: _Optional[_Iterable[float]] = ..., original_max_position_embeddings: _Optional[int] = ..., factor: _Optional[float] = ..., attention_factor: _Optional[float] = ...) -> None: ...

class PEAttention(_message.Message):
    __slots__ = ("standard", "self_extend", "rerope", "leaky_rerope", "dca", "streaming")
    STANDARD_FIELD_NUMBER: _ClassVar[int]
    SELF_EXTEND_FIELD_NUMBER: _ClassVar[int]
    REROPE_FIELD_NUMBER: _ClassVar[int]
    LEAKY_REROPE_FIELD_NUMBER: _ClassVar[int]
    DCA_FIELD_NUMBER: _ClassVar[int]
    STREAMING_FIELD_NUMBER: _ClassVar[int]
    standard: StandardAttention
    self_extend: SelfExtendAttention
    rerope: ReRoPEAttention
    leaky_rerope: LeakyReRoPEAttention
    dca: DCAAttention
    streaming: StreamingAttention
    def __init__(self, standard: _Optional[_Union[StandardAttention, _Mapping]] = ..., self_extend: _Optional[_Union[SelfExtendAttention, _Mapping]] = ..., rerope: _Optional[_Union[ReRoPEAttention, _Mapping]] = ..., leaky_rerope: _Optional[_Union[LeakyReRoPEAttention, _Mapping]] = ..., dca: _Optional[_Union[DCAAttention, _Mapping]] = ..., streaming: _Optional[_Union[StreamingAttention, _Mapping]] = ...) -> None: ...

class StandardAttention(_message.Message):
    __slots__ = ("logn",)
    LOGN_FIELD_NUMBER: _ClassVar[int]
    logn: int
    def __init__(self, logn: _Optional[int] = ...) -> None: ...

class SelfExtendAttention(_message.Message):
    __slots__ = ("logn", "group_size", "window")
    LOGN_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    logn: int
    group_size: int
    window: int
    def __init__(self, logn: _Optional[int] = ..., group_size: _Optional[int] = ..., window: _Optional[int] = ...) -> None: ...

class ReRoPEAttention(_message.Message):
    __slots__ = ("logn", "window")
    LOGN_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    logn: int
    window: int
    def __init__(self, logn: _Optional[int] = ..., window: _Optional[int] = ...) -> None: ...

class LeakyReRoPEAttention(_message.Message):
    __slots__ = ("logn", "window", "leak")
    LOGN_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    LEAK_FIELD_NUMBER: _ClassVar[int]
    logn: int
    window: int
    leak: float
    def __init__(self, logn: _Optional[int] = ..., window: _Optional[int] = ..., leak: _Optional[float] = ...) -> None: ...

class DCAAttention(_message.Message):
    __slots__ = ("logn", "chunk_size", "local_window")
    LOGN_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_WINDOW_FIELD_NUMBER: _ClassVar[int]
    logn: int
    chunk_size: int
    local_window: int
    def __init__(self, logn: _Optional[int] = ..., chunk_size: _Optional[int] = ..., local_window: _Optional[int] = ...) -> None: ...

class StreamingAttention(_message.Message):
    __slots__ = ("logn", "sink_tokens", "window")
    LOGN_FIELD_NUMBER: _ClassVar[int]
    SINK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    logn: int
    sink_tokens: int
    window: int
    def __init__(self, logn: _Optional[int] = ..., sink_tokens: _Optional[int] = ..., window: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "tokens", "model", "pe", "pe_scaling", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop", "logprobs", "request_id", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "ignore_eos", "min_tokens", "stop_token_ids", "top_logprobs", "resume_from", "pe_attention")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PE_FIELD_NUMBER: _ClassVar[int]
    PE_SCALING_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RESUME_FROM_FIELD_NUMBER: _ClassVar[int]
    PE_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    model: str
    pe: str
    pe_scaling: PEScaling
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    logprobs: bool
    request_id: str
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    ignore_eos: bool
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: int
    resume_from: ResumeFrom
    pe_attention: PEAttention
    def __init__(self, prompt: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., model: _Optional[str] = ..., pe: _Optional[str] = ..., pe_scaling: _Optional[_Union[PEScaling, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., logprobs: _Optional[bool] = ..., request_id: _Optional[str] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[int] = ..., resume_from: _Optional[_Union[ResumeFrom, _Mapping]] = ..., pe_attention: _Optional[_Union[PEAttention, _Mapping]] = ...) -> None: ...

class ResumeFrom(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token", "end")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    token: TokenChunk
    end: GenerateEnd
    def __init__(self, token: _Optional[_Union[TokenChunk, _Mapping]] = ..., end: _Optional[_Union[GenerateEnd, _Mapping]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token", "text", "logprob", "top_logprobs")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token: int
    text: str
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token", "text", "logprob")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token: int
    text: str
    logprob: float
    def __init__(self, token: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ...) -> None: ...

class GenerateEnd(_message.Message):
    __slots__ = ("id", "model", "finish_reason", "usage", "pe", "timing")
    ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    id: str
    model: str
    finish_reason: str
    usage: Usage
    pe: PEBlock
    timing: Timing
    def __init__(self, id: _Optional[str] = ..., model: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., pe: _Optional[_Union[PEBlock, _Mapping]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class PEBlock(_message.Message):
    __slots__ = ("scheme", "scaling", "attention_factor", "native_context", "max_context", "attention")
    SCHEME_FIELD_NUMBER: _ClassVar[int]
    SCALING_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FACTOR_FIELD_NUMBER: _ClassVar[int]
    NATIVE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    scheme: str
    scaling: PEScaling
    attention_factor: float
    native_context: int
    max_context: int
    attention: PEAttention
    def __init__(self, scheme: _Optional[str] = ..., scaling: _Optional[_Union[PEScaling, _Mapping]] = ..., attention_factor: _Optional[float] = ..., native_context: _Optional[int] = ..., max_context: _Optional[int] = ..., attention: _Optional[_Union[PEAttention, _Mapping]] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("queue_ms", "prefill_ms", "decode_ms")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    prefill_ms: float
    decode_ms: float
    def __init__(self, queue_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., decode_ms: _Optional[float] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("prompt", "tokens", "model", "pe", "pe_scaling", "request_id", "top_logprobs", "pe_attention")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PE_FIELD_NUMBER: _ClassVar[int]
    PE_SCALING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PE_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    model: str
    pe: str
    pe_scaling: PEScaling
    request_id: str
    top_logprobs: int
    pe_attention: PEAttention
    def __init__(self, prompt: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., model: _Optional[str] = ..., pe: _Optional[str] = ..., pe_scaling: _Optional[_Union[PEScaling, _Mapping]] = ..., request_id: _Optional[str] = ..., top_logprobs: _Optional[int] = ..., pe_attention: _Optional[_Union[PEAttention, _Mapping]] = ...) -> None: ...

class TokenAlternatives(_message.Message):
    __slots__ = ("alternatives",)
    ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
    alternatives: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, alternatives: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("id", "model", "tokens", "token_logprobs", "total_logprob", "perplexity", "num_tokens", "top_logprobs", "pe")
    ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PERPLEXITY_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PE_FIELD_NUMBER: _ClassVar[int]
    id: str
    model: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    token_logprobs: _containers.RepeatedScalarFieldContainer[float]
    total_logprob: float
    perplexity: float
    num_tokens: int
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenAlternatives]
    pe: PEBlock
    def __init__(self, id: _Optional[str] = ..., model: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., token_logprobs: _Optional[_Iterable[float]] = ..., total_logprob: _Optional[float] = ..., perplexity: _Optional[float] = ..., num_tokens: _Optional[int] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenAlternatives, _Mapping]]] = ..., pe: _Optional[_Union[PEBlock, _Mapping]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelCard(_message.Message):
    __slots__ = ("name", "scheme", "native_context", "max_context", "supported_scalings", "parameters", "device", "dtype", "backend", "weights", "training_method", "supported_attention")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SCHEME_FIELD_NUMBER: _ClassVar[int]
    NATIVE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    SUPPORTED_SCALINGS_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    TRAINING_METHOD_FIELD_NUMBER: _ClassVar[int]
    SUPPORTED_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    name: str
    scheme: str
    native_context: int
    max_context: int
    supported_scalings: _containers.RepeatedScalarFieldContainer[str]
    parameters: int
    device: str
    dtype: str
    backend: str
    weights: str
    training_method: str
    supported_attention: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., scheme: _Optional[str] = ..., native_context: _Optional[int] = ..., max_context: _Optional[int] = ..., supported_scalings: _Optional[_Iterable[str]] = ..., parameters: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., backend: _Optional[str] = ..., weights: _Optional[str] = ..., training_method: _Optional[str] = ..., supported_attention: _Optional[_Iterable[str]] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelCard]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelCard, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
