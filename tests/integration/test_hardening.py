"""Issue 38 on a real in-process cluster with a cluster token and two API keys: a FIFO among an
adapter directory's entries (by AddLora, and by a public request naming a --lora-dir entry)
is refused at once while health stays SERVING; admin limits and paths; requests owned by
their key; replica addresses hidden from key-only callers; a replica that fails calls with
FAILED_PRECONDITION is treated as lost and the call moves to another."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import grpc.aio
import pytest
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omni_common.client import Client, generate_request
from omni_common.errors import OmniError
from omni_common.models.lora_files import save_random_lora
from omni_common.net.auth import API_KEY_HEADER, CLUSTER_TOKEN_HEADER
from omni_common.net.rpc import sync_channel
from omnistage.v1 import coordinator_pb2 as cpb
from omnistage.v1 import coordinator_pb2_grpc, stage_pb2, stage_pb2_grpc

from .conftest import InProcessCluster

TOKEN = "hardening-token"
KEY_A, KEY_B = "key-a", "key-b"
SMALL = {"width": 64, "height": 64, "steps": 2, "seed": 3}
OPERATOR = ((CLUSTER_TOKEN_HEADER, TOKEN),)


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    (root / "fifo-dir").mkdir()
    os.mkfifo(root / "fifo-dir" / "a.safetensors")
    os.mkfifo(root / "fifo-file.safetensors")
    return root


@pytest.fixture(scope="module")
def secured(tiny_model: Path, lora_dir: Path) -> Iterator[InProcessCluster]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMNISTAGE_CLUSTER_TOKEN", TOKEN)
        env.setenv("OMNISTAGE_API_KEYS", f"{KEY_A},{KEY_B}")
        running = InProcessCluster(tiny_model, stage_options={"dit-denoise": {"lora_dir": str(lora_dir)}})
        running.start()
        yield running
        running.stop()


def dit_serving(cluster: InProcessCluster) -> bool:
    with sync_channel(cluster.addresses["dit-denoise"]) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def control_code(
    cluster: InProcessCluster, call: str, request: object, timeout: float = 10.0
) -> grpc.StatusCode:
    with sync_channel(cluster.addresses["dit-denoise"], metadata=OPERATOR) as channel:
        try:
            getattr(stage_pb2_grpc.StageControlStub(channel), call)(request, timeout=timeout)
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


def test_a_fifo_in_a_directory_is_refused_by_addlora_and_health_stays_serving(
    secured: InProcessCluster, tmp_path: Path
) -> None:
    os.mkfifo(tmp_path / "a.safetensors")
    for path in (tmp_path, tmp_path / "a.safetensors"):
        # Within a second, as a deadline: a call that blocked in open() would end DEADLINE_EXCEEDED.
        add = stage_pb2.AddLoraRequest(name="f", path=str(path))
        assert control_code(secured, "AddLora", add, timeout=1.0) == grpc.StatusCode.INVALID_ARGUMENT
        push = stage_pb2.LoadWeightsRequest(paths=[str(path)])
        assert control_code(secured, "LoadWeights", push, timeout=1.0) == grpc.StatusCode.INVALID_ARGUMENT
    assert dit_serving(secured)


def test_a_public_request_naming_a_fifo_adapter_is_refused_and_health_stays_serving(
    secured: InProcessCluster,
) -> None:
    with Client(secured.coordinator, api_key=KEY_A) as client:
        for name in ("fifo-dir", "fifo-file"):
            with pytest.raises(OmniError) as refused:
                client.generate("a cat", loras=[name], **SMALL)
            assert refused.value.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
        assert dit_serving(secured)
        assert client.generate("a cat", **SMALL) is not None  # still serving requests


def test_admin_calls_take_the_requests_limits_and_say_invalid_argument_for_nul(
    secured: InProcessCluster, tmp_path: Path
) -> None:
    transformer = QwenImageTransformer2DModel.from_pretrained(secured.model_dir / "transformer")
    adapter = save_random_lora(tmp_path / "a.safetensors", transformer, seed=1)
    for scale in (1e38, -101.0, float("nan")):  # a valid adapter: only its scale is wrong
        huge = stage_pb2.AddLoraRequest(name="s", path=str(adapter), scale=scale)
        assert control_code(secured, "AddLora", huge) == grpc.StatusCode.INVALID_ARGUMENT
    fine = stage_pb2.AddLoraRequest(name="s", path=str(adapter), scale=100.0)
    assert control_code(secured, "AddLora", fine) == grpc.StatusCode.OK
    assert control_code(secured, "RemoveLora", stage_pb2.RemoveLoraRequest(name="s")) == grpc.StatusCode.OK
    nul = stage_pb2.AddLoraRequest(name="n", path="/tmp/a\0b")
    assert control_code(secured, "AddLora", nul) == grpc.StatusCode.INVALID_ARGUMENT
    assert control_code(secured, "LoadWeights", stage_pb2.LoadWeightsRequest(paths=["a\0b"])) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )


class Running:
    """A long request of one key, in a thread, its events as they come."""

    def __init__(self, cluster: InProcessCluster, key: str, request_id: str, metadata=()) -> None:
        self.events: list[cpb.GenerateEvent] = []
        self.error: grpc.RpcError | None = None
        self.stepping = threading.Event()
        self.done = threading.Event()
        request = generate_request("a cat", width=64, height=64, steps=400, request_id=request_id)
        self.channel = sync_channel(cluster.coordinator, metadata=((API_KEY_HEADER, key), *metadata))
        stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)
        threading.Thread(target=self._run, args=(stub, request), daemon=True).start()
        assert self.stepping.wait(60), self.error

    def _run(self, stub, request) -> None:
        try:
            for event in stub.Generate(request, timeout=120):
                self.events.append(event)
                if event.HasField("step"):
                    self.stepping.set()
        except grpc.RpcError as err:
            self.error = err
        finally:
            self.stepping.set()
            self.done.set()
            self.channel.close()


def cancel_code(cluster: InProcessCluster, key: str, request_id: str) -> grpc.StatusCode:
    with sync_channel(cluster.coordinator, metadata=((API_KEY_HEADER, key),)) as channel:
        try:
            coordinator_pb2_grpc.CoordinatorStub(channel).Cancel(
                cpb.CancelRequest(request_id=request_id), timeout=10
            )
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


def test_a_request_is_owned_by_its_key(secured: InProcessCluster) -> None:
    mine = Running(secured, KEY_A, "owned")
    # Another key: its Cancel reads as for an unknown id, and the id is no oracle (it may
    # even use the same id for a request of its own, which runs).
    assert cancel_code(secured, KEY_B, "owned") == grpc.StatusCode.NOT_FOUND
    assert cancel_code(secured, KEY_B, "no-such-id") == grpc.StatusCode.NOT_FOUND
    theirs = Running(secured, KEY_B, "owned")
    assert theirs.error is None and not mine.done.is_set()
    # The owner's own id is taken, for the owner only.
    with Client(secured.coordinator, api_key=KEY_A) as client:
        with pytest.raises(OmniError) as taken:
            client.generate("a cat", request_id="owned", **SMALL)
        assert taken.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert cancel_code(secured, KEY_B, "owned") == grpc.StatusCode.OK
    assert cancel_code(secured, KEY_A, "owned") == grpc.StatusCode.OK
    assert mine.done.wait(30) and theirs.done.wait(30)
    for run in (mine, theirs):
        assert run.error is not None and run.error.code() == grpc.StatusCode.CANCELLED


def test_replica_addresses_are_hidden_from_key_only_callers(secured: InProcessCluster) -> None:
    for metadata, shown in (((), False), (OPERATOR, True)):
        with sync_channel(secured.coordinator, metadata=((API_KEY_HEADER, KEY_A), *metadata)) as channel:
            events = list(
                coordinator_pb2_grpc.CoordinatorStub(channel).Generate(generate_request("a cat", **SMALL))
            )
        started = [e.stage_started for e in events if e.HasField("stage_started")]
        assert started and all(bool(s.replica) == shown for s in started)
        assert all(s.stage for s in started)


class FailingStage(stage_pb2_grpc.StageServicer):
    """A replica that registered with the token and fails every call FAILED_PRECONDITION."""

    def __init__(self, info: stage_pb2.StageInfo) -> None:
        self.info = info
        self.calls = 0

    async def Info(self, request, context):
        return self.info

    async def Run(self, request, context):
        self.calls += 1
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "not today")
        yield stage_pb2.StageEvent()  # pragma: no cover (a generator: Run streams)


def test_a_replica_failing_with_failed_precondition_is_lost_and_the_call_moves(
    secured: InProcessCluster,
) -> None:
    with sync_channel(secured.addresses["dit-denoise"], metadata=OPERATOR) as channel:
        real = stage_pb2_grpc.StageStub(channel).Info(stage_pb2.StageInfoRequest(), timeout=10)

    async def start() -> tuple[grpc.aio.Server, FailingStage]:
        server = grpc.aio.server()
        port = server.add_insecure_port("127.0.0.1:0")
        info = stage_pb2.StageInfo()
        info.CopyFrom(real)
        info.address = f"127.0.0.1:{port}"
        fake = FailingStage(info)
        stage_pb2_grpc.add_StageServicer_to_server(fake, server)
        await server.start()
        return server, fake

    server, fake = secured.call(start())
    try:
        # The real DiT busy with a long request, the fake (just registered, idle) is picked first.
        busy = Running(secured, KEY_A, "blocker")
        with sync_channel(secured.coordinator, metadata=OPERATOR) as channel:
            coordinator_pb2_grpc.RegistryStub(channel).Heartbeat(fake.info, timeout=10)
        with Client(secured.coordinator, api_key=KEY_A) as client:
            assert client.generate("a cat", **SMALL) is not None
        assert fake.calls == 1
        assert cancel_code(secured, KEY_A, "blocker") == grpc.StatusCode.OK
        assert busy.done.wait(30)
    finally:
        with sync_channel(secured.coordinator, metadata=OPERATOR) as channel:
            coordinator_pb2_grpc.RegistryStub(channel).Deregister(fake.info, timeout=10)
        secured.call(server.stop(0))
