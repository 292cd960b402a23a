"""GET /metrics: Prometheus text exposition of the service's and pe_runtime's metrics."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Response

from service.api.deps import MetricsDep
from service.requests.metrics import CONTENT_TYPE

router = APIRouter(tags=["operations"])


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE: {}}}})
async def metrics(service_metrics: MetricsDep) -> Response:
    body = await asyncio.to_thread(service_metrics.render)  # the engine process may take a moment
    return Response(body, media_type=CONTENT_TYPE)
