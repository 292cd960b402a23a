"""POST /score: the log-probability of every token given its prefix, under a chosen PE scaling."""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Body, Depends, Request, Response

from service.api.convert import json_response, score_response
from service.api.deps import EngineDep, require_json
from service.api.handles import ClientDisconnectedError, final_result
from service.api.inputs import prepare_input
from service.api.openapi import INFERENCE_ERRORS, scaling_examples
from service.api.routes.generate import CLIENT_CLOSED_REQUEST
from service.api.schemas.requests import ScoreRequest
from service.api.schemas.responses import ScoreResponse
from service.engine.types import ScoreRequest as EngineScoreRequest
from service.engine.types import ScoreResult

router = APIRouter(tags=["inference"], dependencies=[Depends(require_json)])

# The first token has no prefix, so at least two are needed for one prediction to score.
MIN_SCORED_TOKENS = 2


SCORE_EXAMPLES = scaling_examples({"prompt": "import os\nprint(os.getcwd())\n"})


@router.post("/score", response_model=ScoreResponse, responses=INFERENCE_ERRORS)
async def score(
    body: Annotated[ScoreRequest, Body(openapi_examples=SCORE_EXAMPLES)], request: Request, engine: EngineDep
) -> Response:
    """Score `prompt` (tokenized as for generation) or `tokens` (as given, no BOS added)."""
    prepared = prepare_input(engine, body, new_tokens=0, min_tokens=MIN_SCORED_TOKENS)
    job = EngineScoreRequest(
        request_id=f"score-{uuid.uuid4().hex}",
        model=prepared.model.name,
        tokens=prepared.tokens,
        scaling=prepared.scaling,
    )
    handle = engine.submit(job)
    try:
        result = await final_result(handle, ScoreResult, request.receive)
    except ClientDisconnectedError:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return json_response(score_response(job.model, result))
