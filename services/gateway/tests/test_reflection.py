"""Server reflection answers as grpc.reflection.v1 and as v1alpha (issue 14, item 4)."""

from __future__ import annotations

import grpc
from grpc_reflection.v1alpha import reflection_pb2

from sluice_common.server import create_server


async def _ask(port: int, service: str, request: reflection_pb2.ServerReflectionRequest) -> reflection_pb2.ServerReflectionResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream(
            f"/{service}/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        async for reply in call(iter([request])):
            return reply
    raise AssertionError("no reply")


async def test_reflection_v1_and_v1alpha_list_services_and_describe_files() -> None:
    running = await create_server("127.0.0.1", 0, 0, lambda server: ["sluice.gateway.v1.GatewayService"])
    try:
        for service in ("grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"):
            listed = await _ask(running.port, service, reflection_pb2.ServerReflectionRequest(list_services=""))
            names = {s.name for s in listed.list_services_response.service}
            assert {"grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection", "grpc.health.v1.Health"} <= names
            described = await _ask(
                running.port, service, reflection_pb2.ServerReflectionRequest(file_containing_symbol="grpc.reflection.v1.ServerReflection")
            )
            assert described.file_descriptor_response.file_descriptor_proto, described
    finally:
        await running.server.stop(None)
