"""Reduce JSON Schemas to comparable shapes: field names, JSON types, literals, nesting.

Titles, descriptions, examples, bounds and class names are dropped, since they may rightly differ
between the SDK and the server; what is left is what decides whether a body one side writes is a
body the other side reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Schema = Mapping[str, Any]
Shape = str | tuple[Any, ...] | frozenset[Any]


def shape(schema: Schema, definitions: Schema, *, request: bool) -> Shape:
    """The shape of `schema`, following `$ref`s into `definitions`.

    `request=True` compares what a client may send: the SDK leaves unset fields out for the
    server's defaults, so a request field's requiredness and its `null` alternative are ignored.
    """
    if "$ref" in schema:
        return shape(definitions[schema["$ref"].rsplit("/", 1)[-1]], definitions, request=request)
    if "anyOf" in schema or "oneOf" in schema:
        return _union(schema.get("anyOf", []) + schema.get("oneOf", []), definitions, request=request)
    if "const" in schema:
        return ("const", schema["const"])
    if "enum" in schema:
        return ("enum", frozenset(schema["enum"]))
    kind = schema.get("type")
    if kind == "array":
        return ("array", shape(schema.get("items", {}), definitions, request=request))
    if kind == "object" and "properties" in schema:
        required = set(schema.get("required", ()))
        fields = (
            (name, shape(field, definitions, request=request), None if request else name in required)
            for name, field in schema["properties"].items()
        )
        return ("object", frozenset(fields))
    if kind == "object":
        values = schema.get("additionalProperties", True)
        return ("map", "any" if isinstance(values, bool) else shape(values, definitions, request=request))
    return kind if isinstance(kind, str) else "any"


def _union(members: list[Schema], definitions: Schema, *, request: bool) -> Shape:
    shapes: set[Shape] = set()
    for member in members:
        member_shape = shape(member, definitions, request=request)
        shapes.update(member_shape if isinstance(member_shape, frozenset) else {member_shape})
    if request:
        shapes.discard("null")
    return next(iter(shapes)) if len(shapes) == 1 else frozenset(shapes)
