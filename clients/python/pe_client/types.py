"""Request and response bodies of the pe-serve HTTP API.

Requests forbid unknown fields, as the server does, so a misspelt keyword fails here with a clear
pydantic error instead of a round trip. Responses ignore fields they do not know, so a newer
server can add fields without breaking older clients.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypedDict

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from pe_client.attention import PEAttention
from pe_client.scaling import PEScaling

Scheme = Literal[
    "learned",
    "sinusoidal",
    "rope",
    "alibi",
    "t5_bias",
    "nope",
    "shaw",
    "transformer_xl",
    "cope",
    "rope_alibi",
]
FinishReason = Literal["length", "stop", "eos"]

# The server's schema publishes `pe_attention` as a free-form object (it validates the rule when it
# resolves the request, naming the field); the SDK validates the typed rule but publishes the
# server's shape, so the two schemas stay comparable field by field (tests/clients).
_WireAttention = Annotated[PEAttention, WithJsonSchema({"type": "object", "additionalProperties": True})]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Response(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class ScoreRequest(_Request):
    """Score `prompt` or `tokens` (exactly one): log-probability of each token given its prefix;
    `top_logprobs` (0..20) also asks for that many alternatives at every position. `pe_attention`
    (a typed rule from `pe_client.attention`, or its dict) chooses how attention places queries and
    keys; unset, the server runs standard attention."""

    prompt: str | None = None
    tokens: list[int] | None = None
    model: str | None = None
    pe: Scheme | None = None
    pe_scaling: PEScaling | None = None
    pe_attention: _WireAttention | None = None
    top_logprobs: int | None = None


class ResumeFrom(_Request):
    """Where a cut stream left off: the ids of the tokens received, in order."""

    tokens: list[int]


class GenerateRequest(ScoreRequest):
    """A generation; fields left unset take the server's defaults (each control off).

    `repetition_penalty` follows transformers (1 is off), `presence_penalty` and
    `frequency_penalty` OpenAI (-2..2); before `min_tokens` tokens, EOS, `stop_token_ids` and stop
    strings end nothing; `top_logprobs` (0..20) asks for that many alternatives per token.
    `resume_from` continues a stream that was cut after those tokens; the SDK's streams set it
    themselves when they resume, so it is only for a stream resumed by hand.
    """

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    stream: bool | None = None
    logprobs: bool | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    resume_from: ResumeFrom | None = None


class ScoreParams(TypedDict, total=False):
    """Keyword form of `ScoreRequest` (the typed `**kwargs` of `score()`)."""

    prompt: str
    tokens: list[int]
    model: str
    pe: Scheme
    pe_scaling: PEScaling | dict[str, object]
    pe_attention: PEAttention | dict[str, object]
    top_logprobs: int


class GenerateParams(ScoreParams, total=False):
    """Keyword form of `GenerateRequest`; `stream` is chosen by the method called, not passed."""

    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    stop: list[str]
    logprobs: bool
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    ignore_eos: bool
    min_tokens: int
    stop_token_ids: list[int]
    resume_from: ResumeFrom | dict[str, list[int]]


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens read from the server's prefix cache


class PEInfo(_Response):
    """The positional encoding the request actually ran with.

    `scaling` is the server's resolved form: every field with its default filled in, which may
    include fields a request for that type would not send, so it stays a plain dict. `attention`
    is the attention rule it ran with (`pe_attention`), `{"type": "standard"}` when none was asked
    for (or from a server that predates `pe_attention`); a plain dict too
    (`pe_client.attention.parse_attention` types it), so a rule newer than this SDK still parses.
    """

    scheme: str
    scaling: dict[str, Any] | None
    attention_factor: float
    native_context: int
    max_context: int
    attention: dict[str, Any] = Field(default_factory=lambda: {"type": "standard"})


class Timing(_Response):
    queue_ms: float
    prefill_ms: float
    decode_ms: float


class TopLogprob(_Response):
    """One of the most likely tokens at a position, under the model's raw distribution."""

    token: int
    text: str
    logprob: float


class GenerateResponse(_Response):
    id: str
    model: str
    text: str
    tokens: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[TopLogprob]] | None = None
    finish_reason: FinishReason
    usage: Usage
    pe: PEInfo
    timing: Timing


class ScoreResponse(_Response):
    """`token_logprobs[0]` is None: the first token has no prefix to be predicted from."""

    model: str
    tokens: list[int]
    token_logprobs: list[float | None]
    total_logprob: float
    perplexity: float
    num_tokens: int
    top_logprobs: list[list[TopLogprob] | None] | None = None  # asked for: the first is None
    pe: PEInfo | None = None  # the scaling and attention rule it was scored under (None: older server)


class ModelInfo(_Response):
    name: str
    scheme: str
    native_context: int
    max_context: int
    supported_scalings: list[str]
    supported_attention: list[str]  # the `pe_attention` types its scheme can apply
    parameters: int
    device: str
    dtype: str
    backend: str  # the decode path its steps run on: eager, compiled, cuda_graphs or c
    weights: str  # how its linear weights are kept at run time: float, int8 or int4
    training_method: str | None = None  # a training-side zoo member's: pi-ft, yarn-ft, pose, randpos


class TokenizerInfo(_Response):
    """A model's tokenizer: its special tokens and chat template (None for a model without one)."""

    model: str
    bos_token_id: int | None
    eos_token_id: int | None
    chat_template: str | None
    model_max_length: int


class ChatMessage(BaseModel):
    """One turn of a conversation, rendered by the model's chat template."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["system", "user", "assistant"]
    content: str


class ModelList(_Response):
    models: list[ModelInfo]


class StreamToken(_Response):
    """One generated token of a stream; `text` may be empty in the middle of a UTF-8 sequence."""

    token: int
    text: str
    logprob: float | None = None
    top_logprobs: list[TopLogprob] | None = None


class StreamEnd(_Response):
    """The last event of a stream, before `[DONE]`: the non-streaming response less text and tokens."""

    id: str
    model: str
    finish_reason: FinishReason
    usage: Usage
    pe: PEInfo
    timing: Timing


StreamEvent = StreamToken | StreamEnd


class Health(_Response):
    """`live`: the process answers (`/healthz`); `ready`: models loaded and not draining (`/readyz`)."""

    live: bool
    ready: bool


class ErrorDetail(_Response):
    type: str
    message: str
    param: str | None


class ErrorBody(_Response):
    """Every error the server sends, as a status body or as a stream event."""

    error: ErrorDetail
