"""OpenAPI documentation shared by the routes: request examples, error statuses, SSE events."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from service.api.schemas.openai import ChatCompletionChunk, OpenAIErrorResponse
from service.requests.responses import ErrorResponse, StreamEnd, StreamToken
from service.requests.scaling import SCALING_EXAMPLES

_DESCRIPTIONS = {
    401: "Missing or wrong API key (when one is configured).",
    404: "Unknown model.",
    413: "Request body over the size limit.",
    415: "Body not declared as JSON.",
    422: "Invalid input; `param` names the field.",
    429: "Queue full; retry after `Retry-After` seconds.",
    503: "Loading or draining.",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorResponse, "description": _DESCRIPTIONS[status]} for status in statuses}


INFERENCE_ERRORS = error_responses(401, 404, 413, 415, 422, 429, 503)


def openai_errors() -> dict[int | str, dict[str, Any]]:
    """The `/v1` routes' errors: OpenAI's shape, invalid input as 400."""
    descriptions = {**_DESCRIPTIONS, 400: _DESCRIPTIONS[422]}
    return {
        status: {"model": OpenAIErrorResponse, "description": descriptions[status]}
        for status in (400, 401, 404, 413, 415, 429, 503)
    }


def _component_schema(model: type[BaseModel]) -> dict[str, Any]:
    """`model`'s JSON schema with nested models referenced from the OpenAPI components.

    The nested models (usage, pe, timing) are components already, through GenerateResponse.
    """
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    schema.pop("$defs", None)
    return schema


# The JSON payload of a `data:` line: a token, the end, or an error.
STREAM_PAYLOAD_SCHEMA: dict[str, Any] = {
    "oneOf": [
        _component_schema(StreamToken),
        _component_schema(StreamEnd),
        {"$ref": "#/components/schemas/ErrorResponse"},
    ]
}


def _event_stream_schema(payload: dict[str, Any]) -> dict[str, Any]:
    """One event of a stream, as generic SSE tools read it (OpenAPI 3.1 has `schema` describe each
    event): an object whose `data` field is a string, either JSON of `payload`'s shape
    (`contentMediaType` and `contentSchema`) or the closing `[DONE]`."""
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "type": "string",
                "anyOf": [
                    {"contentMediaType": "application/json", "contentSchema": payload},
                    {"const": "[DONE]"},
                ],
            },
            "event": {"type": "string"},
            "id": {"type": "string"},
        },
    }


STREAM_EVENT_SCHEMA = _event_stream_schema(STREAM_PAYLOAD_SCHEMA)

# Models that only appear inside stream events, which FastAPI does not register as components.
STREAM_ONLY_MODELS: tuple[type[BaseModel], ...] = (ChatCompletionChunk,)


def openai_stream(chunk: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """The `/v1` routes' 200 with `stream: true`: `chunk` events, an error event, then `[DONE]`."""
    payload = {
        "oneOf": [
            {"$ref": f"#/components/schemas/{chunk.__name__}"},
            {"$ref": "#/components/schemas/OpenAIErrorResponse"},
        ]
    }
    return {
        200: {
            "content": {"text/event-stream": {"schema": _event_stream_schema(payload)}},
            "description": f"With `stream: true`, `text/event-stream`: `{chunk.__name__}` events, then "
            "`data: [DONE]`; a late failure is an error event.",
        }
    }


def register_stream_models(app: FastAPI) -> None:
    """Add `STREAM_ONLY_MODELS` (and the models they nest) to the app's OpenAPI components."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in STREAM_ONLY_MODELS:
                definition = model.model_json_schema(
                    ref_template="#/components/schemas/{model}", mode="serialization"
                )
                for name, nested in definition.pop("$defs", {}).items():
                    components.setdefault(name, nested)
                components.setdefault(model.__name__, definition)
        return app.openapi_schema or build()

    app.openapi = openapi  # type: ignore[method-assign]


def scaling_examples(request: dict[str, Any]) -> dict[str, Any]:
    """OpenAPI examples of `request`: as is (the default model and scaling), then on RoPE per scaling type."""
    return {
        "default": {"summary": "The default model, its own scaling", "value": request},
        **{
            scaling_type: {
                "summary": f"RoPE with {scaling_type} scaling",
                "value": {**request, "pe": "rope", "pe_scaling": example},
            }
            for scaling_type, example in SCALING_EXAMPLES.items()
        },
    }
