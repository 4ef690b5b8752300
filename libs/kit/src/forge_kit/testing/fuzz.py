"""Fuzzing gRPC handlers with hypothesis: random but well-formed requests built from a message's
descriptor, sent to a real server, so a handler's answer to odd input is checked the way a client
would see it (a status code, never a crash or an ``INTERNAL``).

Strings favour the inputs that break services: empty, whitespace, very long, path traversal,
SQL and format metacharacters, non-ASCII; numbers hit their type's bounds; enums include values
the schema does not define (proto3 enums are open).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import descriptor as _descriptor
from google.protobuf import message_factory
from google.protobuf.message import Message
from hypothesis import strategies as st

FieldDescriptor = _descriptor.FieldDescriptor

NASTY_STRINGS = [
    "",
    " ",
    "a" * 300,
    "../../etc/passwd",
    "'; DROP TABLE jobs; --",
    "%s%s%n{0}{}",
    "\x00",
    "ümlaut-日本語-🙂",
    "UPPER_case.Name",
    "-leading-dash",
]

_INT_BOUNDS: dict[int, tuple[int, int]] = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def _ints(low: int, high: int) -> st.SearchStrategy[int]:
    edges = [v for v in (low, high, 0, 1, -1, 2**31 - 1) if low <= v <= high]
    return st.one_of(
        st.sampled_from(edges), st.integers(min_value=max(low, -1000), max_value=min(high, 1000))
    )


def _scalar(field: Any) -> st.SearchStrategy[Any]:
    kind = field.type
    if kind == FieldDescriptor.TYPE_STRING:
        return st.one_of(st.sampled_from(NASTY_STRINGS), st.text(max_size=40))
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.one_of(
            st.sampled_from([0.0, -1.0, 1e308, float("inf"), float("-inf"), float("nan")]),
            st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, width=32),
        )
    if kind == FieldDescriptor.TYPE_ENUM:
        numbers = [v.number for v in field.enum_type.values]
        return st.sampled_from([*numbers, max(numbers) + 1, 999])
    low, high = _INT_BOUNDS[kind]
    return _ints(low, high)


def messages(descriptor: Any, *, max_depth: int = 3) -> st.SearchStrategy[Message]:
    """Messages of type ``descriptor`` with any subset of fields set."""
    return _messages(descriptor, max_depth)


def _messages(descriptor: Any, depth: int) -> st.SearchStrategy[Message]:
    cls = message_factory.GetMessageClass(descriptor)
    if depth <= 0:
        return st.just(cls())
    optional: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        if field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
            key_field = field.message_type.fields_by_name["key"]
            value_field = field.message_type.fields_by_name["value"]
            value = (
                _messages(value_field.message_type, depth - 1)
                if value_field.type == FieldDescriptor.TYPE_MESSAGE
                else _scalar(value_field)
            )
            optional[field.name] = st.dictionaries(_scalar(key_field), value, max_size=3)
            continue
        single = (
            _messages(field.message_type, depth - 1)
            if field.type == FieldDescriptor.TYPE_MESSAGE
            else _scalar(field)
        )
        is_repeated = field.is_repeated
        optional[field.name] = st.lists(single, max_size=4) if is_repeated else single
    return st.fixed_dictionaries({}, optional=optional).map(lambda values: _build(cls, descriptor, values))


def _build(cls: type[Message], descriptor: Any, values: dict[str, Any]) -> Message:
    message = cls()
    for name, value in values.items():
        field = descriptor.fields_by_name[name]
        target = getattr(message, name)
        if field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
            for key, item in value.items():
                if isinstance(item, Message):
                    target[key].CopyFrom(item)
                else:
                    target[key] = item
        elif field.is_repeated:
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                for item in value:
                    target.add().CopyFrom(item)
            else:
                target.extend(value)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            target.CopyFrom(value)
        else:
            setattr(message, name, value)
    return message


#: Statuses that mean the server failed rather than refused: a fuzzed request must never get one.
SERVER_FAULTS = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS})


def unary_caller(
    channel: grpc.Channel, service: Any, method: Any, token: str
) -> Callable[[Message], grpc.StatusCode]:
    """A function sending one request to ``method`` and returning the status it got. Server
    streams are read until they end or a few items have arrived."""
    path = f"/{service.full_name}/{method.name}"
    response_cls = message_factory.GetMessageClass(method.output_type)
    metadata = (("authorization", f"Bearer {token}"),)
    if method.server_streaming:
        stream = channel.unary_stream(
            path,
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=response_cls.FromString,
        )

        def call_stream(request: Message) -> grpc.StatusCode:
            try:
                for i, _ in enumerate(stream(request, metadata=metadata, timeout=0.5)):
                    if i >= 3:
                        break
            except grpc.RpcError as exc:
                return exc.code()  # type: ignore[no-any-return]
            return grpc.StatusCode.OK

        return call_stream
    unary = channel.unary_unary(
        path,
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=response_cls.FromString,
    )

    def call(request: Message) -> grpc.StatusCode:
        try:
            unary(request, metadata=metadata, timeout=10)
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]
        return grpc.StatusCode.OK

    return call
