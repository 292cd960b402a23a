"""POST /generate: text generation with a per-request scheme and RoPE scaling, JSON or SSE."""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Request, Response

from service.api.deps import AliasesDep, EngineDep, FirstTokenDep, RequestIdDep, SubmissionDep, require_json
from service.api.handles import result_of
from service.api.once import answer_once
from service.api.openapi import INFERENCE_ERRORS, STREAM_EVENT_SCHEMA, scaling_examples
from service.api.responses import json_body
from service.api.streaming import EventStreamResponse, generation_events
from service.engine.types import GenerationResult
from service.requests.bodies import GenerateRequest
from service.requests.build import generate_job
from service.requests.convert import generate_response, token_text
from service.requests.prepare import prepare_generation
from service.requests.responses import GenerateResponse

router = APIRouter(tags=["inference"], dependencies=[Depends(require_json)])

_EXAMPLE_REQUEST: dict[str, Any] = {
    "prompt": "def fib(n):",
    "max_new_tokens": 32,
    "temperature": 0.8,
    "seed": 7,
}
GENERATE_EXAMPLES = {
    **scaling_examples(_EXAMPLE_REQUEST),
    "stream": {"summary": "Streamed as server-sent events", "value": {**_EXAMPLE_REQUEST, "stream": True}},
}

_STREAM_DESCRIPTION = (
    'With `stream: true`, `text/event-stream`: `data: {"token", "text"}` per token, a final '
    '`data: {"finish_reason", "usage", ...}`, then `data: [DONE]`; a late failure is a '
    '`data: {"error": {...}}` event. With `resume_from`, the events after the tokens it holds.'
)


@router.post(
    "/generate",
    response_model=GenerateResponse,
    responses={
        200: {
            "content": {"text/event-stream": {"schema": STREAM_EVENT_SCHEMA}},
            "description": _STREAM_DESCRIPTION,
        },
        **INFERENCE_ERRORS,
    },
)
async def generate(
    body: Annotated[GenerateRequest, Body(openapi_examples=GENERATE_EXAMPLES)],
    request: Request,
    engine: EngineDep,
    request_id: RequestIdDep,
    first_token: FirstTokenDep,
    submission: SubmissionDep,
    aliases: AliasesDep,
) -> Response:
    """Generate from `prompt` or `tokens` on the model picked by `model` / `pe`, scaled by `pe_scaling`."""
    prepared = prepare_generation(engine, body, stream=body.stream, aliases=aliases)
    response_id = f"gen-{uuid.uuid4().hex}"
    job = generate_job(response_id, body, prepared, stream=body.stream)
    text = token_text(engine, job.model)
    model = prepared.target.name  # as the request named it
    if body.stream:
        handle = submission.submit(engine, job, prepared.names)
        events = generation_events(
            handle,
            response_id=response_id,
            model=model,
            request_id=request_id,
            on_event=first_token,
            text=text,
        )
        return EventStreamResponse(events, on_abort=handle.cancel)

    async def answer() -> bytes:
        result = await result_of(
            submission.submit(engine, job, prepared.names), GenerationResult, first_token
        )
        return json_body(generate_response(response_id, model, result, text))

    return await answer_once(request, body, answer)
