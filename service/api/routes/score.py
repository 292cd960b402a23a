"""POST /score: the log-probability of every token given its prefix, under a chosen PE scaling."""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Body, Depends, Request, Response

from service.api.deps import AliasesDep, EngineDep, SubmissionDep, require_json
from service.api.handles import result_of
from service.api.once import answer_once
from service.api.openapi import INFERENCE_ERRORS, scaling_examples
from service.api.responses import json_body
from service.engine.types import ScoreResult
from service.requests.bodies import ScoreRequest
from service.requests.build import score_job
from service.requests.convert import score_response, token_text
from service.requests.prepare import prepare_scored
from service.requests.responses import ScoreResponse

router = APIRouter(tags=["inference"], dependencies=[Depends(require_json)])

SCORE_EXAMPLES = scaling_examples({"prompt": "import os\nprint(os.getcwd())\n"})


@router.post("/score", response_model=ScoreResponse, responses=INFERENCE_ERRORS)
async def score(
    body: Annotated[ScoreRequest, Body(openapi_examples=SCORE_EXAMPLES)],
    request: Request,
    engine: EngineDep,
    submission: SubmissionDep,
    aliases: AliasesDep,
) -> Response:
    """Score `prompt` (tokenized as for generation) or `tokens` (as given, no BOS added)."""
    prepared = prepare_scored(engine, body, aliases)
    job = score_job(f"score-{uuid.uuid4().hex}", body, prepared)

    async def answer() -> bytes:
        result = await result_of(submission.submit(engine, job, prepared.names), ScoreResult)
        scored = score_response(prepared.target.name, result, token_text(engine, job.model))
        # Alternatives only when asked for; the `pe` block only for a request that chose its
        # positions (`pe_scaling`, `pe_attention`, or an alias's), so a plain /score answers the
        # SPEC's keys.
        omit = {"top_logprobs"} if scored.top_logprobs is None else set()
        if body.pe_scaling is None and body.pe_attention is None and prepared.target.asked is None:
            omit.add("pe")
        return json_body(scored, omit=omit or None)

    return await answer_once(request, body, answer)
