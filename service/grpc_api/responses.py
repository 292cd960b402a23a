"""Engine results -> protobuf responses, through the request core's response models.

Going through `service.requests.convert` keeps one definition of every derived value (finish reason,
perplexity, the resolved `pe` block), so the two protocols cannot disagree about them.
"""

from __future__ import annotations

from service.engine.types import GenerationResult, ModelInfo, PEInfo, ScoreResult, TokenEvent
from service.grpc_api import pe_serve_pb2 as pb
from service.grpc_api.codec import attention_message, scaling_message
from service.requests.convert import (
    TokenText,
    finish_reason,
    model_card,
    pe_block,
    score_response,
    timing_block,
    top_logprob_entries,
    usage,
)
from service.requests.responses import TopLogprobEntry


def token_chunk(event: TokenEvent, text: TokenText) -> pb.GenerateResponse:
    """One token; its alternatives (when asked for) are the very entries an SSE event carries."""
    alternatives = None
    if event.top_logprobs is not None:
        alternatives = _alternatives(top_logprob_entries(event.top_logprobs, text))
    chunk = pb.TokenChunk(
        token=event.token, text=event.text, logprob=event.logprob, top_logprobs=alternatives
    )
    return pb.GenerateResponse(token=chunk)


def generate_end(request_id: str, model: str, result: GenerationResult) -> pb.GenerateResponse:
    end = pb.GenerateEnd(
        id=request_id,
        model=model,
        finish_reason=finish_reason(result),
        usage=pb.Usage(**usage(result).model_dump()),
        pe=pe_message(result.pe),
        timing=pb.Timing(**timing_block(result.timing).model_dump()),
    )
    return pb.GenerateResponse(end=end)


def pe_message(pe: PEInfo) -> pb.PEBlock:
    block = pe_block(pe)
    scaling = scaling_message(block.scaling) if block.scaling is not None else None
    return pb.PEBlock(
        **block.model_dump(exclude={"scaling", "attention"}),
        scaling=scaling,
        attention=attention_message(block.attention),
    )


def score_message(request_id: str, model: str, result: ScoreResult, text: TokenText) -> pb.ScoreResponse:
    """As `/score` answers, but without the leading nulls: the first token has no log-probability."""
    body = score_response(model, result, text)
    return pb.ScoreResponse(
        id=request_id,
        model=body.model,
        tokens=body.tokens,
        token_logprobs=[logprob for logprob in body.token_logprobs[1:] if logprob is not None],
        total_logprob=body.total_logprob,
        perplexity=body.perplexity,
        num_tokens=body.num_tokens,
        top_logprobs=[
            pb.TokenAlternatives(alternatives=_alternatives(entries))
            for entries in (body.top_logprobs or [])[1:]
            if entries is not None
        ],
        pe=pe_message(result.pe),
    )


def _alternatives(entries: list[TopLogprobEntry]) -> list[pb.TopLogprob]:
    return [pb.TopLogprob(**entry.model_dump()) for entry in entries]


def models_message(infos: list[ModelInfo]) -> pb.ListModelsResponse:
    return pb.ListModelsResponse(
        models=[pb.ModelCard(**model_card(info).model_dump(exclude_none=True)) for info in infos]
    )
