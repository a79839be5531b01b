"""Hostile input, property-based: every RPC of every service, fed messages that hypothesis
builds from the protos' own descriptors (any field set or not, any value of its type, random
strings and bytes, unknown enum values, nested messages, maps and lists) and bytes that are
no message at all, on a real in-process cluster, with the cluster token (so the handlers
themselves are fuzzed; without it every call stops at the door: test_auth.py).

Each call must end in a clean status — never UNKNOWN or INTERNAL (an unhandled exception, a
crash) — and afterwards every service is alive and a real request returns, bit for bit, the
image it returned before the fuzz.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omni_common.client import Client
from omni_common.net.auth import CLUSTER_TOKEN_HEADER
from omni_common.net.rpc import sync_channel
from omni_common.runtime import feeds

from .conftest import InProcessCluster

pytestmark = pytest.mark.slow

TOKEN = "fuzz-cluster-token"
STAGE_SERVICES = ("omnistage.v1.Stage", "omnistage.v1.StageControl", "omnistage.v1.TensorStore")
COORDINATOR_SERVICES = ("omnistage.v1.Registry", "omnistage.v1.Coordinator")
MESSAGES_PER_SERVICE = 200
MAX_PIXELS = 64 * 64  # anything larger is refused up front, so a fuzzed Generate stays cheap
# Strings that mean something to the services: names, paths, prefixes, numbers.
TRICKY = st.sampled_from(
    ["", "dit-denoise", "vae-decode", "denoise", "latents", "qwen-image-tiny", "../../etc/passwd",
     "/dev/shm/omnistage-0", "omnistage-", "127.0.0.1:1", "%s%n", "\x00", "9" * 40, "é" * 300]
)  # fmt: skip
# Bytes that are no message at all: random, truncated, groups nested past any parser's limit.
RAW = st.binary(max_size=256) | st.sampled_from(
    [b"\x0b" * 500 + b"\x0c" * 500, b"\x0a\xff\xff\xff\x0f", b"\xff" * 16]
)
REFERENCE = {"prompt": "before and after the fuzz", "seed": 5, "width": 32, "height": 32, "steps": 3}


def scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    kind = field.type
    if kind in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.floats(allow_nan=True, allow_infinity=True, width=32 if kind == field.TYPE_FLOAT else 64)
    if kind in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SFIXED32):
        return st.integers(-(2**31), 2**31 - 1)
    if kind in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
        return st.integers(0, 2**32 - 1)
    if kind in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_SFIXED64):
        return st.integers(-(2**63), 2**63 - 1)
    if kind in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return st.integers(0, 2**64 - 1)
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.TYPE_STRING:
        return TRICKY | st.text(max_size=48)
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=96)
    if kind == FieldDescriptor.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values]) | st.integers(-3, 40)
    raise AssertionError(f"no strategy for {field.full_name}")


def message(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """Any message of `descriptor`: each field unset or set to any value of its type."""
    cls = message_factory.GetMessageClass(descriptor)
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if depth >= 3:
                continue
            if field.message_type.GetOptions().map_entry:
                key, value = (
                    field.message_type.fields_by_name["key"],
                    field.message_type.fields_by_name["value"],
                )
                values = message(value.message_type, depth + 1) if value.message_type else scalar(value)
                fields[field.name] = st.dictionaries(scalar(key), values, max_size=3)
                continue
            one: st.SearchStrategy[Any] = st.deferred(lambda f=field: message(f.message_type, depth + 1))
        else:
            one = scalar(field)
        repeated = field.is_repeated
        fields[field.name] = st.none() | (st.lists(one, max_size=3) if repeated else one)

    def build(values: dict[str, Any]) -> Message:
        built = cls()
        for name, value in values.items():
            if value is None:
                continue
            target = getattr(built, name, None)
            if isinstance(value, dict):
                for k, v in value.items():
                    if isinstance(v, Message):
                        target[k].CopyFrom(v)
                    else:
                        target[k] = v
            elif isinstance(value, list):
                for item in value:
                    target.add().CopyFrom(item) if isinstance(item, Message) else target.append(item)
            elif isinstance(value, Message):
                target.CopyFrom(value)
            else:
                setattr(built, name, value)
        return built

    return st.fixed_dictionaries(fields).map(build)


def rpcs(services: tuple[str, ...]) -> list[tuple[str, Any, bool, int]]:
    """(path, input descriptor, server streaming, examples) of every RPC of `services`: each
    service gets MESSAGES_PER_SERVICE messages, shared by its methods."""
    pool = descriptor_pool.Default()
    found = []
    for name in services:
        methods = pool.FindServiceByName(name).methods
        examples = math.ceil(MESSAGES_PER_SERVICE / len(methods))
        for method in methods:
            assert not method.client_streaming, "client streams are not fuzzed yet"
            found.append((f"/{name}/{method.name}", method.input_type, method.server_streaming, examples))
    return found


def wire(request: Message | bytes) -> bytes:
    return request if isinstance(request, bytes) else request.SerializeToString()


def call(channel: grpc.Channel, path: str, request: Message | bytes, streaming: bool) -> grpc.StatusCode:
    kind = channel.unary_stream if streaming else channel.unary_unary
    stub = kind(path, request_serializer=wire, response_deserializer=bytes)
    try:
        response = stub(request, timeout=20)
        if streaming:
            for _ in response:
                pass
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def fuzz_method(
    channel: grpc.Channel, path: str, descriptor: Descriptor, streaming: bool, examples: int
) -> set[str]:
    """Send `examples` fuzzed messages to one RPC; returns the status codes seen."""
    seen: set[str] = set()

    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(message(descriptor) | RAW)
    def fuzz(request: Message | bytes) -> None:
        code = call(channel, path, request, streaming)
        seen.add(code.name)
        assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (path, request)

    fuzz()
    return seen


@pytest.fixture(scope="module")
def fuzzed(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[InProcessCluster, bytes]]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMNISTAGE_CLUSTER_TOKEN", TOKEN)
        env.setattr(feeds, "OPEN_WAIT_S", 0.05)  # a fuzzed Feed names no open call: fail fast
        limits = {"max_pixels": MAX_PIXELS}
        # Fuzzed StartProfile calls write their traces under a directory of the test's own.
        stage_limits = {**limits, "profile_dir": str(tmp_path_factory.mktemp("profiles"))}
        running = InProcessCluster(
            tiny_model,
            stage_options={stage: stage_limits for stage in ("ar-encoder", "dit-denoise", "vae-decode")},
            coordinator_options=limits,
        )
        running.start()
        with Client(running.coordinator) as client:
            before = client.generate_result(**REFERENCE).encoded  # type: ignore[arg-type]
        yield running, before
        running.stop()


@pytest.mark.parametrize(
    ("target", "services"),
    [("dit-denoise", STAGE_SERVICES), ("vae-decode", STAGE_SERVICES), ("coordinator", COORDINATOR_SERVICES)],
)
def test_fuzzed_messages_get_clean_statuses_and_the_cluster_serves_on_unchanged(
    fuzzed, target, services
) -> None:
    cluster, before = fuzzed
    codes: dict[str, set[str]] = {}
    with sync_channel(cluster.addresses[target], metadata=((CLUSTER_TOKEN_HEADER, TOKEN),)) as channel:
        for path, descriptor, streaming, examples in rpcs(services):
            codes[path] = fuzz_method(channel, path, descriptor, streaming, examples)
    assert all(codes.values()), codes
    with Client(cluster.coordinator) as client:
        after = client.generate_result(**REFERENCE).encoded  # type: ignore[arg-type]
    assert after == before, "the fuzz changed what the cluster serves"
