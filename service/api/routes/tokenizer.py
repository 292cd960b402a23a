"""POST /tokenize, POST /detokenize, GET /tokenizer_info: a model's tokenizer, served remotely.

Evaluation clients count and cut prompts with the server's own tokenizer through these routes
(vLLM serves them under these names). They use the tokenizer the engine uses, with the same
encoding rules: a prompt starts like a document (BOS first) unless `add_special_tokens` is false.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query

from service.api.chat_template import render_chat
from service.api.deps import AliasesDep, EngineDep, require_json
from service.api.openapi import error_responses
from service.api.schemas.tokenizer import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
)
from service.requests.errors import ErrorKind, RequestError
from service.requests.prepare import checked_ids, resolve_model_name

router = APIRouter(tags=["tokenizer"])

_ERRORS = error_responses(401, 404, 413, 415, 422, 503)


@router.post("/tokenize", dependencies=[Depends(require_json)], responses=_ERRORS)
async def tokenize(body: TokenizeRequest, engine: EngineDep, aliases: AliasesDep) -> TokenizeResponse:
    if (body.prompt is None) == (body.messages is None):
        raise RequestError(
            ErrorKind.INVALID, "Exactly one of 'prompt' and 'messages' is required.", param="prompt"
        )
    model = resolve_model_name(engine, body.model, aliases)
    if body.messages is not None:
        text = render_chat(
            model.name,
            engine.tokenizer_info(model.name),
            [message.for_template() for message in body.messages],
            add_generation_prompt=body.add_generation_prompt,
        )
        special = bool(body.add_special_tokens)
    else:
        assert body.prompt is not None
        text, special = body.prompt, body.add_special_tokens is not False
    tokens = engine.tokenize(model.name, text, add_special_tokens=special)
    return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=model.max_context)


@router.post("/detokenize", dependencies=[Depends(require_json)], responses=_ERRORS)
async def detokenize(body: DetokenizeRequest, engine: EngineDep, aliases: AliasesDep) -> DetokenizeResponse:
    model = resolve_model_name(engine, body.model, aliases)
    tokens = checked_ids(model, body.tokens, field="tokens")
    return DetokenizeResponse(prompt=engine.detokenize(model.name, list(tokens)))


@router.get("/tokenizer_info", responses=error_responses(401, 404, 422, 503))
async def tokenizer_info(
    engine: EngineDep,
    aliases: AliasesDep,
    model: Annotated[
        str | None, Query(min_length=1, max_length=256, description="Default model if absent.")
    ] = None,
) -> TokenizerInfoResponse:
    info = resolve_model_name(engine, model, aliases)
    tokenizer = engine.tokenizer_info(info.name)
    return TokenizerInfoResponse(
        model=model or info.name,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        pad_token=tokenizer.pad_token,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        chat_template=tokenizer.chat_template,
        model_max_length=info.max_context,
    )
