"""One callable per pe-serve gRPC method, on one channel, sync (`grpc.Channel`) or async
(`grpc.aio.Channel`): both kinds of channel make their callables the same way."""

from __future__ import annotations

from typing import Any

from pe_client.grpc import pe_serve_pb2 as pb
from pe_client.grpc._base import method, serialize
from pe_client.grpc._health import HEALTH_CHECK, parse_health


class Stubs:
    def __init__(self, channel: Any) -> None:
        def unary(path: str, parse: Any) -> Any:
            return channel.unary_unary(path, request_serializer=serialize, response_deserializer=parse)

        self.generate = channel.unary_stream(
            method("Generate"),
            request_serializer=serialize,
            response_deserializer=pb.GenerateResponse.FromString,
        )
        self.score = unary(method("Score"), pb.ScoreResponse.FromString)
        self.list_models = unary(method("ListModels"), pb.ListModelsResponse.FromString)
        self.abort = unary(method("Abort"), pb.AbortResponse.FromString)
        self.health = unary(HEALTH_CHECK, parse_health)
