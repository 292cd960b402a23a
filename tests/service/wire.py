"""Protobuf wire-format pieces, for requests no message object can express (wrong types, unknown fields)."""

from __future__ import annotations

import struct

VARINT, FIXED64, LENGTH_DELIMITED, FIXED32 = 0, 1, 2, 5
PE_SCALING_FIELD = 5


def varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def varint_field(number: int, value: int) -> bytes:
    return tag(number, VARINT) + varint(value)


def double(number: int, value: float) -> bytes:
    return tag(number, FIXED64) + struct.pack("<d", value)


def fixed32(number: int, value: int) -> bytes:
    return tag(number, FIXED32) + struct.pack("<I", value)


def length_delimited(number: int, data: bytes) -> bytes:
    return tag(number, LENGTH_DELIMITED) + varint(len(data)) + data


def scaling(member: int, fields: bytes) -> bytes:
    """`pe_scaling` holding oneof member number `member` with the given encoded fields."""
    return length_delimited(PE_SCALING_FIELD, length_delimited(member, fields))
