"""Access control on a real in-process cluster with a cluster token and API keys: every
internal RPC of every service refuses a caller without the token (UNAUTHENTICATED), the
public API a caller without a listed key (PERMISSION_DENIED), health stays open, and a
request with a key still gets its image (the services' own calls carry the token)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omni_common.client import Client
from omni_common.errors import OmniError
from omni_common.net.auth import CLUSTER_TOKEN_HEADER, INTERNAL_SERVICES
from omni_common.net.rpc import sync_channel
from omnistage.v1 import coordinator_pb2, coordinator_pb2_grpc, stage_pb2

from .conftest import InProcessCluster

TOKEN = "cluster-secret-for-tests"
KEYS = ("key-one", "key-two")


@pytest.fixture(scope="module")
def secured(tiny_model: Path) -> Iterator[InProcessCluster]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMNISTAGE_CLUSTER_TOKEN", TOKEN)
        env.setenv("OMNISTAGE_API_KEYS", ",".join(KEYS))
        running = InProcessCluster(tiny_model)
        running.start()
        yield running
        running.stop()


def internal_methods() -> list[tuple[str, str, bool, bool, type]]:
    """(service, method, client streaming, server streaming, input message class) of every
    internal RPC, from the protos' descriptors."""
    pool = descriptor_pool.Default()
    methods = []
    for name in sorted(INTERNAL_SERVICES):
        service = pool.FindServiceByName(name)
        for method in service.methods:
            message = message_factory.GetMessageClass(method.input_type)
            methods.append((name, method.name, method.client_streaming, method.server_streaming, message))
    return methods


def call_without(address: str, metadata: list[tuple[str, str]], method: tuple) -> grpc.StatusCode:
    service, name, client_streaming, server_streaming, message = method
    path = f"/{service}/{name}"
    with sync_channel(address) as channel:
        kinds = {
            (False, False): channel.unary_unary,
            (False, True): channel.unary_stream,
            (True, False): channel.stream_unary,
            (True, True): channel.stream_stream,
        }
        stub = kinds[(client_streaming, server_streaming)](
            path, request_serializer=lambda m: m.SerializeToString(), response_deserializer=lambda b: b
        )
        request = iter([message()]) if client_streaming else message()
        try:
            response = stub(request, metadata=metadata, timeout=10)
            if server_streaming:
                list(response)
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("credential", [[], [(CLUSTER_TOKEN_HEADER, "wrong")]], ids=["none", "wrong"])
def test_every_internal_rpc_of_every_service_needs_the_cluster_token(secured, credential) -> None:
    methods = internal_methods()
    assert len(methods) >= 8
    for name, address in secured.addresses.items():
        for method in methods:
            code = call_without(address, credential, method)
            assert code == grpc.StatusCode.UNAUTHENTICATED, (name, method[:2], code)


def test_a_forged_heartbeat_is_refused_and_routes_nothing(secured) -> None:
    forged = stage_pb2.StageInfo(stage="vae-decode", model="qwen-image-tiny", address="127.0.0.1:1")
    with sync_channel(secured.coordinator) as channel, pytest.raises(grpc.RpcError) as caught:
        coordinator_pb2_grpc.RegistryStub(channel).Heartbeat(forged, timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with Client(secured.coordinator, api_key=KEYS[0]) as client:
        assert client.list_models()[0].replicas["vae-decode"] == 1


def test_the_public_api_needs_a_listed_key_and_health_needs_none(secured) -> None:
    for key in ("", "not-a-key"):
        with Client(secured.coordinator, api_key=key) as client, pytest.raises(OmniError) as caught:
            client.list_models()
        assert caught.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert "key-one" not in caught.value.message
    with sync_channel(secured.coordinator, metadata=(("authorization", f"Bearer {KEYS[1]}"),)) as channel:
        models = coordinator_pb2_grpc.CoordinatorStub(channel).ListModels(coordinator_pb2.ListModelsRequest())
        assert models.models
    for address in secured.addresses.values():
        with sync_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_a_request_with_a_key_gets_its_image_through_the_secured_stages(secured) -> None:
    with Client(secured.coordinator, api_key=KEYS[1]) as client:
        image = client.generate("a locked door", width=64, height=64, steps=2, seed=1)
    assert image.size == (64, 64)
