"""One callable per pe-serve gRPC method, on one channel, sync (`grpc.Channel`) or async
(`grpc.aio.Channel`): both kinds of channel make their callables the same way."""

from __future__ import annotations

from typing import Any

from pe_client.grpc import pe_serve_pb2 as pb
from pe_client.grpc._base import method, serialize
from pe_client.grpc._health import HEALTH_CHECK, parse_health


class Stubs:
    def __init__(self, channel: Any) -> None:
        self.generate = channel.unary_stream(
            method("Generate"),
            request_serializer=serialize,
            response_deserializer=pb.GenerateResponse.FromString,
        )
        self.score = channel.unary_unary(
            method("Score"), request_serializer=serialize, response_deserializer=pb.ScoreResponse.FromString
        )
        self.list_models = channel.unary_unary(
            method("ListModels"),
            request_serializer=serialize,
            response_deserializer=pb.ListModelsResponse.FromString,
        )
        self.abort = channel.unary_unary(
            method("Abort"), request_serializer=serialize, response_deserializer=pb.AbortResponse.FromString
        )
        self.health = channel.unary_unary(
            HEALTH_CHECK, request_serializer=serialize, response_deserializer=parse_health
        )
