"""The SDK's typed models <-> pe-serve's protobuf messages.

Requests are built from the JSON body the HTTP client would send (`pe_client._base.build_body`),
so both clients validate and fill arguments the same way; responses become the same typed
models the HTTP client returns. `pe_scaling` and `pe_attention` are `{"type": ..., fields}` in JSON
and a `oneof` whose field name is the type on the wire (an attention rule's `logn` is a field of
each type's message, so both map the same way).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from google.protobuf.message import Message

from pe_client.grpc import pe_serve_pb2 as pb

MessageT = TypeVar("MessageT", bound=Message)

_SCALING_ONEOF = "scaling"
_ATTENTION_ONEOF = "attention"


def request_message(message_type: type[MessageT], body: Mapping[str, Any]) -> MessageT:
    """The request message for a JSON body; raises TypeError/ValueError for what the wire cannot carry."""
    fields = {name: _typed_message(name, value) for name, value in body.items()}
    return message_type(**fields)


def _typed_message(name: str, value: Any) -> Any:
    """A body's `pe_scaling` / `pe_attention` object as its oneof message; other values as they are."""
    if isinstance(value, Mapping):
        if name == "pe_scaling":
            return scaling_message(value)
        if name == "pe_attention":
            return attention_message(value)
    return value


def scaling_message(scaling: Mapping[str, Any]) -> pb.PEScaling:
    """`{"type": "yarn", "factor": 4.0}` -> `PEScaling(yarn=YarnScaling(factor=4.0))`."""
    fields = {name: value for name, value in scaling.items() if name != "type"}
    return pb.PEScaling(**{str(scaling["type"]): fields})


def attention_message(attention: Mapping[str, Any]) -> pb.PEAttention:
    """`{"type": "rerope", "window": 512, "logn": 4096}` ->
    `PEAttention(rerope=ReRoPEAttention(window=512, logn=4096))`; no `type` is `standard`, as the
    server reads it."""
    fields = {name: value for name, value in attention.items() if name != "type"}
    return pb.PEAttention(**{str(attention.get("type", "standard")): fields})


def response_fields(message: Message) -> dict[str, Any]:
    """Every field of a response as JSON would carry it: unset optional and message fields are None."""
    fields: dict[str, Any] = {}
    for descriptor in message.DESCRIPTOR.fields:
        value = getattr(message, descriptor.name)
        if descriptor.is_repeated:
            fields[descriptor.name] = [
                response_fields(item) if isinstance(item, Message) else item for item in value
            ]
        elif descriptor.message_type is pb.PEAttention.DESCRIPTOR and not message.HasField(descriptor.name):
            continue  # no rule reported: the model's default (standard), as over HTTP
        elif descriptor.has_presence and not message.HasField(descriptor.name):
            fields[descriptor.name] = None
        elif isinstance(value, pb.PEScaling):
            fields[descriptor.name] = scaling_fields(value)
        elif isinstance(value, pb.PEAttention):
            fields[descriptor.name] = attention_fields(value)
        elif isinstance(value, Message):
            fields[descriptor.name] = response_fields(value)
        else:
            fields[descriptor.name] = value
    return fields


def scaling_fields(scaling: pb.PEScaling) -> dict[str, Any] | None:
    """The resolved scaling as `/generate` reports it (only the fields the server set)."""
    scaling_type = scaling.WhichOneof(_SCALING_ONEOF)
    if scaling_type is None:
        return None
    fields = getattr(scaling, scaling_type).ListFields()
    resolved = {
        descriptor.name: list(value) if descriptor.is_repeated else value for descriptor, value in fields
    }
    return {"type": scaling_type, **resolved}


def attention_fields(attention: pb.PEAttention) -> dict[str, Any] | None:
    """The resolved attention rule as `/generate` reports it: `type`, its fields, and `logn` when set."""
    attention_type = attention.WhichOneof(_ATTENTION_ONEOF)
    if attention_type is None:
        return None
    fields = getattr(attention, attention_type).ListFields()
    resolved = {descriptor.name: value for descriptor, value in fields}
    logn = resolved.pop("logn", None)  # first on the wire, last in JSON
    return {"type": attention_type, **resolved, **({} if logn is None else {"logn": logn})}
