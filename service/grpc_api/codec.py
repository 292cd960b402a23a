"""Protobuf messages <-> the JSON-shaped values the request core validates and answers with.

A gRPC request is parsed here and turned into the very dict a JSON body would be, so that the
request schemas (`service.requests.bodies`) validate both protocols with the same bounds and name
the same fields. Only what the wire format itself can get wrong is checked here: bytes that do not parse,
and fields the schema does not know (an unknown number, or a known one sent with another wire
type, which protobuf keeps aside as unknown rather than failing).

`pe_scaling` and `pe_attention` are each a `oneof` on the wire and `{"type": ..., fields}` in JSON;
the oneof's field name is the type (an attention rule's `logn` is a field of each type's message,
so the two map the same way).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

from service.grpc_api import pe_serve_pb2 as pb
from service.requests.errors import ErrorKind, RequestError

MessageT = TypeVar("MessageT", bound=Message)

# The messages that are one `oneof` whose field name is the JSON object's `type`, and its name.
_TYPED_ONEOFS: dict[type[Message], str] = {pb.PEScaling: "scaling", pb.PEAttention: "attention"}


def parse_request(message_type: type[MessageT], data: bytes) -> MessageT:
    """The request message, or a 422 naming what the wire format got wrong."""
    try:
        message = message_type.FromString(data)
    except DecodeError as error:
        raise RequestError(
            ErrorKind.INVALID, f"The request is not a valid {message_type.DESCRIPTOR.full_name}: {error}"
        ) from None
    _reject_unknown_fields(message, path="")
    return message


def request_fields(message: Message) -> dict[str, Any]:
    """The fields the client set, as a JSON body would carry them (unset means absent)."""
    fields: dict[str, Any] = {}
    for descriptor, value in message.ListFields():
        if isinstance(value, pb.PEScaling | pb.PEAttention):
            fields[descriptor.name] = typed_fields(value)
        elif isinstance(value, Message):
            fields[descriptor.name] = request_fields(value)
        elif descriptor.is_repeated:
            fields[descriptor.name] = list(value)
        else:
            fields[descriptor.name] = value
    return fields


def typed_fields(message: pb.PEScaling | pb.PEAttention) -> dict[str, Any]:
    """`{"type": <oneof field>, ...its fields}`; `{}` (no type) when the oneof is unset."""
    kind = message.WhichOneof(_TYPED_ONEOFS[type(message)])
    if kind is None:
        return {}
    return {"type": kind, **request_fields(getattr(message, kind))}


def scaling_message(resolved: Mapping[str, Any]) -> pb.PEScaling:
    """The oneof for a `{"type": ..., fields}` dict such as `RopeScaling.to_dict()`."""
    return pb.PEScaling(**_typed_oneof(resolved))


def attention_message(resolved: Mapping[str, Any]) -> pb.PEAttention:
    """The oneof for a `{"type": ..., fields, "logn"?}` dict such as `AttentionRule.to_dict()`."""
    return pb.PEAttention(**_typed_oneof(resolved))


def _typed_oneof(resolved: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    fields = {name: value for name, value in resolved.items() if name != "type"}
    return {resolved["type"]: fields}


def _reject_unknown_fields(message: Message, *, path: str) -> None:
    """422 for the first unknown field, named like pydantic names an extra JSON key.

    A known number with another wire type is named by its field; an unknown number by the number,
    except in `PEScaling` and `PEAttention`, where an unknown member of the oneof is an unknown type.
    """
    by_number = message.DESCRIPTOR.fields_by_number
    unknown_fields = UnknownFieldSet(message)
    if len(unknown_fields):
        number = unknown_fields[0].field_number
        known = by_number.get(number)
        if isinstance(message, pb.PEScaling | pb.PEAttention):
            kind = _TYPED_ONEOFS[type(message)]
            name, problem = "type", f"unknown {kind} type" if known is None else "wrong wire type"
        elif known is not None:
            name, problem = known.name, "wrong wire type"
        else:
            name, problem = str(number), "unknown field number"
        param = f"{path}{name}"
        raise RequestError(ErrorKind.INVALID, f"{param}: {problem} (field {number}).", param=param)
    for descriptor, value in message.ListFields():
        if isinstance(value, Message):
            # The oneof level has no name in JSON: `pe_scaling.factor`, not `pe_scaling.yarn.factor`.
            typed = isinstance(message, pb.PEScaling | pb.PEAttention)
            inner = path if typed else f"{path}{descriptor.name}."
            _reject_unknown_fields(value, path=inner)
