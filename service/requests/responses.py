"""Response bodies, as the SPEC fixes them; the SDK's models are checked against these schemas."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from service.engine.types import ClientFinishReason


class ErrorDetail(BaseModel):
    type: str
    message: str
    param: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PEBlock(BaseModel):
    """The positional encoding the request actually ran with, scaling resolved with its defaults."""

    scheme: str
    scaling: dict[str, Any] | None
    attention_factor: float
    native_context: int
    max_context: int
    attention: dict[str, Any] = Field(
        default_factory=lambda: {"type": "standard"},
        description="The attention rule the request ran with (`pe_attention`), fields resolved.",
    )


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = Field(0, description="Prompt tokens read from the prefix cache, not computed.")


class TimingBlock(BaseModel):
    queue_ms: float
    prefill_ms: float
    decode_ms: float


class TopLogprobEntry(BaseModel):
    """One of the most likely tokens at a position, under the raw distribution."""

    token: int
    text: str
    logprob: float


class GenerateResponse(BaseModel):
    id: str
    model: str
    text: str
    tokens: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[TopLogprobEntry]] | None = Field(
        None, description="Per generated token, its `top_logprobs` most likely alternatives."
    )
    finish_reason: ClientFinishReason
    usage: Usage
    pe: PEBlock
    timing: TimingBlock


class StreamToken(BaseModel):
    """One SSE event per generated token; `logprob` only when the request asked for logprobs."""

    token: int
    text: str
    logprob: float | None = None
    top_logprobs: list[TopLogprobEntry] | None = None


class StreamEnd(BaseModel):
    """The last event before `data: [DONE]`: what the non-streaming response has besides the text."""

    id: str
    model: str
    finish_reason: ClientFinishReason
    usage: Usage
    pe: PEBlock
    timing: TimingBlock


class ScoreResponse(BaseModel):
    model: str
    tokens: list[int]
    token_logprobs: list[float | None] = Field(description="Same length as tokens; the first is null.")
    total_logprob: float
    perplexity: float
    num_tokens: int
    top_logprobs: list[list[TopLogprobEntry] | None] | None = Field(
        None,
        description="With `top_logprobs` > 0: per token, its most likely alternatives; the first is null.",
    )
    pe: PEBlock | None = Field(
        None,
        description="The scaling and attention rule the text was scored under; present when the "
        "request chose either (`pe_scaling`, `pe_attention`).",
    )


class ModelCard(BaseModel):
    name: str
    scheme: str
    native_context: int
    max_context: int
    supported_scalings: list[str]
    supported_attention: list[str] = Field(description="The `pe_attention` types its scheme can apply.")
    parameters: int
    device: str
    dtype: str
    backend: str = Field(description="The decode path its steps run on: eager, compiled, cuda_graphs or c.")
    weights: str = Field(description="How its linear weights are kept at run time: float, int8 or int4.")
    training_method: str | None = Field(
        None,
        description="For a training-side zoo member, how it was trained: pi-ft, yarn-ft, pose or randpos.",
    )


class ModelsResponse(BaseModel):
    models: list[ModelCard]


class StatusResponse(BaseModel):
    status: Literal["ok", "ready"]


class RunningRequestInfo(BaseModel):
    """A running request as its owner sees it (`GET` and `POST /requests/{id}/cancel`)."""

    request_id: str
    endpoint: str = Field(description="The route or gRPC method that made it.")
    models: list[str]
    jobs: int = Field(description="Its unfinished engine jobs (several for OpenAI's `n`).")
    tokens: int = Field(description="Prompt plus requested new tokens, as the per-key token limit counts.")
    age_s: float
    cancelled: bool = Field(
        description="Stopped by its owner (`POST /requests/{id}/cancel` or gRPC `Abort`)."
    )
