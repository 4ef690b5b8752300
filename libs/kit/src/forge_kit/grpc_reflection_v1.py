"""gRPC server reflection v1 (``grpc.reflection.v1.ServerReflection``) beside v1alpha.

``grpcio-reflection`` ships only v1alpha, while newer clients (grpcurl, Postman, grpcui) ask v1
first and some ask nothing else. The two protocols are the same messages under another package
name, so the wire bytes are identical: v1 is served by the library's own v1alpha servicer through a
handler registered under the v1 name, and the v1 file descriptor — the v1alpha one renamed — is
added to the default pool so a client can also describe the v1 service itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import _async as reflection_aio
from grpc_reflection.v1alpha import reflection_pb2

SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
V1ALPHA_SERVICE_NAME = "grpc.reflection.v1alpha.ServerReflection"
_FILE = "grpc/reflection/v1/reflection.proto"


def _register_v1_descriptor() -> None:
    """Add the v1 reflection proto to the default pool once (renamed from v1alpha's)."""
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = _FILE, "grpc.reflection.v1"

    def renamed(type_name: str) -> str:
        return type_name.replace(".grpc.reflection.v1alpha.", ".grpc.reflection.v1.")

    for message in proto.message_type:
        for field in message.field:
            if field.type_name:
                field.type_name = renamed(field.type_name)
    for service in proto.service:
        for method in service.method:
            method.input_type, method.output_type = renamed(method.input_type), renamed(method.output_type)
    pool.Add(proto)


def enable_reflection(service_names: Sequence[str], server: grpc.aio.Server) -> None:
    """Serve reflection v1 and v1alpha on ``server``, listing ``service_names`` and both
    reflection services."""
    _register_v1_descriptor()
    names = [*service_names, SERVICE_NAME, V1ALPHA_SERVICE_NAME]
    servicer = reflection_aio.ReflectionServicer(names)
    for name in (V1ALPHA_SERVICE_NAME, SERVICE_NAME):
        handler = grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": handler}),)
        )
