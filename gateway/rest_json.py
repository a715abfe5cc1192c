"""Protobuf answers (ModelConfig, ModelStatistics) as the JSON Triton's HTTP endpoint writes:
field names as in the .proto, 64-bit integers as numbers (protobuf's own JSON mapping writes them
as strings), enums by name, and scalars at their defaults included."""
from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message


def _value(field: FieldDescriptor, value):
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return message_dict(value)
    if field.type == FieldDescriptor.TYPE_ENUM:
        return field.enum_type.values_by_number[value].name if value in field.enum_type.values_by_number else value
    if field.type == FieldDescriptor.TYPE_BYTES:
        return value.decode("latin-1")
    return value


def message_dict(message: Message) -> dict:
    out: dict = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            out[field.name] = {k: _value(value_field, v) for k, v in value.items()}
        elif field.is_repeated:
            out[field.name] = [_value(field, v) for v in value]
        elif field.containing_oneof is not None:
            if message.WhichOneof(field.containing_oneof.name) == field.name:
                out[field.name] = _value(field, value)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            if message.HasField(field.name):
                out[field.name] = _value(field, value)
        else:
            out[field.name] = _value(field, value)
    return out
