"""`grpc.health.v1.Health/Check` for the pe-serve service, as the SDK's `Health` result."""

from __future__ import annotations

from grpc_health.v1 import health_pb2

from pe_client.grpc._base import SERVICE
from pe_client.types import Health

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
parse_health = health_pb2.HealthCheckResponse.FromString


def health_request() -> health_pb2.HealthCheckRequest:
    return health_pb2.HealthCheckRequest(service=SERVICE)


def health_result(response: health_pb2.HealthCheckResponse) -> Health:
    """The server answered, so it is live; ready means SERVING (models loaded, not draining)."""
    return Health(live=True, ready=response.status == health_pb2.HealthCheckResponse.SERVING)
