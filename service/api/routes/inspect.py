"""POST /inspect: pe_runtime's tables for a scheme and scaling, as JSON, for the playground's plots.

Pure computation on this process's CPU, independent of the engine: it answers while models load.
A plain `def`, so FastAPI runs it on its thread pool and a large table never stalls the event loop.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Response

from service.api.deps import require_json
from service.api.inspection import inspect_tables
from service.api.openapi import error_responses
from service.api.responses import json_response
from service.api.schemas.inspect import InspectRequest, InspectResponse

router = APIRouter(tags=["inspect"], dependencies=[Depends(require_json)])

INSPECT_EXAMPLES: dict[str, Any] = {
    "yarn": {
        "summary": "RoPE frequencies and tables under YaRN",
        "value": {"pe": "rope", "pe_scaling": {"type": "yarn", "factor": 4.0}, "length": 64},
    },
    "alibi": {"summary": "ALiBi slopes and bias", "value": {"pe": "alibi", "length": 32, "num_heads": 6}},
    "t5_bias": {"summary": "T5 relative-position buckets", "value": {"pe": "t5_bias", "length": 64}},
}


@router.post("/inspect", response_model=InspectResponse, responses=error_responses(401, 413, 415, 422))
def inspect(body: Annotated[InspectRequest, Body(openapi_examples=INSPECT_EXAMPLES)]) -> Response:
    """The cos/sin table and inverse frequencies (RoPE), bias matrix (ALiBi), buckets (T5) or table."""
    return json_response(inspect_tables(body))
