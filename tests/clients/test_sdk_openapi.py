"""The SDK's pydantic models and the server's published schema agree field by field.

Both sides are reduced to shapes (see schema_shape.py): field names, JSON types, literal values,
nesting and, for responses, which fields are required. Any drift (a field added, renamed or
retyped on either side) fails here instead of in a user's program.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from pe_client import GenerateRequest, GenerateResponse, ScoreRequest, ScoreResponse, StreamEnd, StreamToken
from pe_client.types import ErrorBody, ModelList
from pydantic import BaseModel, TypeAdapter

from tests.clients.schema_shape import Schema, shape
from tests.live_server import LiveServer


@pytest.fixture(scope="module")
def openapi(server: LiveServer) -> dict[str, Any]:
    document: dict[str, Any] = httpx.get(server.url("/openapi.json")).raise_for_status().json()
    return document


def sdk_shape(model: type[BaseModel], *, request: bool) -> object:
    schema = model.model_json_schema()
    return shape(schema, schema.get("$defs", {}), request=request)


def json_schema(operation: Schema, *, request: bool) -> Schema:
    if request:
        body: Schema = operation["requestBody"]["content"]["application/json"]["schema"]
        return body
    answer: Schema = operation["responses"]["200"]["content"]["application/json"]["schema"]
    return answer


@pytest.mark.parametrize(
    ("model", "method", "path", "is_request"),
    [
        (GenerateRequest, "post", "/generate", True),
        (ScoreRequest, "post", "/score", True),
        (GenerateResponse, "post", "/generate", False),
        (ScoreResponse, "post", "/score", False),
        (ModelList, "get", "/models", False),
    ],
)
def test_bodies_agree_with_openapi(
    openapi: dict[str, Any], model: type[BaseModel], method: str, path: str, is_request: bool
) -> None:
    server_schema = json_schema(openapi["paths"][path][method], request=is_request)
    components = openapi["components"]["schemas"]
    assert sdk_shape(model, request=is_request) == shape(server_schema, components, request=is_request)


def test_error_body_agrees_with_openapi(openapi: dict[str, Any]) -> None:
    components = openapi["components"]["schemas"]
    error_schema = openapi["paths"]["/generate"]["post"]["responses"]["422"]["content"]["application/json"]
    assert sdk_shape(ErrorBody, request=False) == shape(error_schema["schema"], components, request=False)


def test_stream_events_agree_with_openapi(openapi: dict[str, Any]) -> None:
    """An event's JSON data is a token, the end event or an error: the SDK reads exactly that union."""
    components = openapi["components"]["schemas"]
    content = openapi["paths"]["/generate"]["post"]["responses"]["200"]["content"]
    data = content["text/event-stream"]["schema"]["properties"]["data"]
    (json_data,) = [
        choice for choice in data["anyOf"] if choice.get("contentMediaType") == "application/json"
    ]
    sdk_events = TypeAdapter(StreamToken | StreamEnd | ErrorBody).json_schema()
    assert shape(sdk_events, sdk_events.get("$defs", {}), request=False) == shape(
        json_data["contentSchema"], components, request=False
    )


def test_a_drifted_field_would_be_caught(openapi: dict[str, Any]) -> None:
    """The comparison is not vacuous: a request model with one field renamed does not match."""

    class Drifted(ScoreRequest):
        pe_scaling_typo: int | None = None

    server_schema = json_schema(openapi["paths"]["/score"]["post"], request=True)
    components = openapi["components"]["schemas"]
    assert sdk_shape(Drifted, request=True) != shape(server_schema, components, request=True)
