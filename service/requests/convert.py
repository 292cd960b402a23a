"""Engine results -> response models, for every transport: the only place that knows both vocabularies.

The gRPC API builds its messages from these models too, so a derived value (finish reason,
perplexity, the resolved `pe` block) has one definition and the protocols cannot disagree.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from service.engine.types import (
    ClientFinishReason,
    Engine,
    GenerationResult,
    ModelInfo,
    PEInfo,
    ScoreResult,
    Timing,
    TopLogprobs,
)
from service.model.attention_rules import StandardAttention
from service.requests.errors import ErrorKind, RequestError
from service.requests.responses import (
    GenerateResponse,
    ModelCard,
    PEBlock,
    ScoreResponse,
    TimingBlock,
    TopLogprobEntry,
    Usage,
)

# One token's text, for reporting alternatives (the tokenizer lives on this side of the engine too).
TokenText = Callable[[int], str]

_CLIENT_FINISH_REASONS: tuple[ClientFinishReason, ...] = ("length", "stop", "eos")


def pe_block(pe: PEInfo) -> PEBlock:
    return PEBlock(
        scheme=pe.scheme,
        scaling=pe.scaling.to_dict() if pe.scaling is not None else None,
        attention_factor=pe.attention_factor,
        native_context=pe.native_context,
        max_context=pe.max_context,
        attention=(pe.attention or StandardAttention()).to_dict(),
    )


def timing_block(timing: Timing) -> TimingBlock:
    return TimingBlock(queue_ms=timing.queue_ms, prefill_ms=timing.prefill_ms, decode_ms=timing.decode_ms)


def usage(result: GenerationResult) -> Usage:
    """As if the stream had not been cut: a resumed generation counts the tokens made before the cut."""
    return Usage(
        prompt_tokens=result.prompt_tokens,
        completion_tokens=result.resumed + len(result.tokens),
        cached_tokens=result.cached_tokens,
    )


def finish_reason(result: GenerationResult) -> ClientFinishReason:
    """The client-facing reason; a generation the engine cancelled (shutdown) is a failure to retry."""
    for reason in _CLIENT_FINISH_REASONS:
        if result.finish_reason == reason:
            return reason
    raise RequestError(
        ErrorKind.UNAVAILABLE,
        f"The generation ended early ({result.finish_reason}); retry.",
        error_type="request_cancelled",
    )


def token_text(engine: Engine, model: str) -> TokenText:
    def text(token: int) -> str:
        return engine.detokenize(model, [token])

    return text


def top_logprob_entries(alternatives: TopLogprobs, text: TokenText) -> list[TopLogprobEntry]:
    return [
        TopLogprobEntry(token=entry.token, text=text(entry.token), logprob=entry.logprob)
        for entry in alternatives
    ]


def generate_response(
    response_id: str, model: str, result: GenerationResult, text: TokenText
) -> GenerateResponse:
    return GenerateResponse(
        id=response_id,
        model=model,
        text=result.text,
        tokens=list(result.tokens),
        logprobs=list(result.logprobs) if result.logprobs is not None else None,
        top_logprobs=(
            [top_logprob_entries(position, text) for position in result.top_logprobs]
            if result.top_logprobs is not None
            else None
        ),
        finish_reason=finish_reason(result),
        usage=usage(result),
        pe=pe_block(result.pe),
        timing=timing_block(result.timing),
    )


def score_response(model: str, result: ScoreResult, text: TokenText) -> ScoreResponse:
    predicted = len(result.tokens) - 1
    return ScoreResponse(
        model=model,
        tokens=list(result.tokens),
        token_logprobs=list(result.token_logprobs),
        total_logprob=result.total_logprob,
        perplexity=math.exp(-result.total_logprob / predicted),
        num_tokens=len(result.tokens),
        top_logprobs=(
            [top_logprob_entries(at, text) if at is not None else None for at in result.top_logprobs]
            if result.top_logprobs is not None
            else None
        ),
        pe=pe_block(result.pe),
    )


def model_card(info: ModelInfo) -> ModelCard:
    return ModelCard(
        name=info.name,
        scheme=info.scheme,
        native_context=info.native_context,
        max_context=info.max_context,
        supported_scalings=list(info.supported_scalings),
        supported_attention=list(info.supported_attention),
        parameters=info.parameters,
        device=info.device,
        dtype=info.dtype,
        backend=info.backend,
        weights=info.weights,
        training_method=info.training_method,
    )
