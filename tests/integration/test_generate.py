"""The whole request path in one process: real gRPC servers, real shared memory."""

from __future__ import annotations

import io
import math
import threading
import time

import grpc
import numpy as np
import pytest
from PIL import Image

from omni_common.client import Client
from omni_common.errors import Cancelled, InvalidArgument, NotFound, OmniError, ResourceExhausted
from omni_common.net.rpc import sync_channel
from omnistage.v1 import stage_pb2, stage_pb2_grpc, tensor_pb2

SMALL = {"width": 64, "height": 64, "steps": 4, "seed": 3}


def wait_until_no_leases(cluster, timeout_s: float = 10.0) -> None:
    """Releases run in the background: give them a moment, then every lease must be gone."""
    deadline = time.monotonic() + timeout_s
    while any(cluster.live_leases().values()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cluster.live_leases() == dict.fromkeys(cluster.live_leases(), 0)


def test_events_arrive_in_order_and_end_with_a_png(cluster) -> None:
    with Client(cluster.coordinator) as client:
        events = list(client.events("a cat", image_format="png", **SMALL))
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[0] == "accepted" and kinds[-1] == "result"
    started = [e.stage_started.stage for e in events if e.HasField("stage_started")]
    finished = [e.stage_finished.stage for e in events if e.HasField("stage_finished")]
    assert started == finished == ["ar-encoder", "dit-denoise", "vae-decode"]
    assert [e.step.step for e in events if e.HasField("step")] == [1, 2, 3, 4]
    result = events[-1].result
    image = Image.open(io.BytesIO(result.image))
    assert image.size == (64, 64) and (result.width, result.height) == (64, 64)
    wait_until_no_leases(cluster)


def test_same_seed_same_image_in_every_format_and_raw_tensor_matches(cluster) -> None:
    with Client(cluster.coordinator) as client:
        first = client.generate_result("a dog", return_tensor=True, **SMALL)
        second = client.generate_result("a dog", image_format="png", **SMALL)
        other = client.generate_result("a dog", **{**SMALL, "seed": 4})
    assert second.encoded.startswith(b"\x89PNG")
    assert first.encoded == np.asarray(second.image).tobytes()
    assert first.encoded != other.encoded
    assert first.tensor is not None and first.tensor.shape == (3, 64, 64)
    pixels = (first.tensor.transpose(1, 2, 0) * 255).round().astype(np.uint8)
    assert np.array_equal(pixels, np.asarray(first.image))


def test_list_models_names_the_served_model(cluster) -> None:
    with Client(cluster.coordinator) as client:
        (model,) = client.list_models()
    assert model.name == "qwen-image-tiny" and model.family == "qwenimage"
    assert dict(model.replicas) == {"ar-encoder": 1, "dit-denoise": 1, "vae-decode": 1}


BAD_REQUESTS = [
    ({"width": 72}, InvalidArgument, "multiple of 16"),
    ({"width": 10**6}, InvalidArgument, "width"),
    ({"width": 4096, "height": 4096}, ResourceExhausted, "pixels"),
    ({"steps": 0}, InvalidArgument, "num_inference_steps"),
    ({"steps": 10**6}, InvalidArgument, "num_inference_steps"),
    ({"steps": 1}, InvalidArgument, "at least 2"),  # diffusers itself returns NaN here
    ({"guidance": math.nan}, InvalidArgument, "true_cfg_scale"),
    ({"guidance": math.inf}, InvalidArgument, "true_cfg_scale"),
    ({"prompt": "x" * 100_000}, InvalidArgument, "prompt"),
    ({"model": "no-such-model"}, NotFound, "unknown model"),
    ({"request_id": "../etc"}, InvalidArgument, "request_id"),
    ({"images": [Image.new("RGB", (64, 64))]}, InvalidArgument, "takes no input images"),
    ({"images": [b"\x89PNG not really"]}, InvalidArgument, "image"),
    ({"options": {"strength": "0.5"}}, InvalidArgument, "strength"),
]


@pytest.mark.parametrize(("change", "error", "words"), BAD_REQUESTS)
def test_bad_requests_get_a_clear_status_and_the_service_stays_up(
    cluster,
    change,
    error,
    words,
) -> None:
    options = {**SMALL, **change}
    prompt = options.pop("prompt", "a cat")
    with Client(cluster.coordinator) as client:
        with pytest.raises(error) as caught:
            client.generate(prompt, **options)
        assert words in caught.value.message
        assert "/dev/shm" not in caught.value.message and "Traceback" not in caught.value.message
        assert client.generate("a cat", **SMALL).size == (64, 64)


def _stage_run(address: str, state: tensor_pb2.StageState, outputs: tuple[str, ...] = ()) -> grpc.RpcError:
    params = stage_pb2.GenerationParams(
        model="qwen-image-tiny",
        prompt="x",
        width=64,
        height=64,
        num_inference_steps=2,
        true_cfg_scale=1.0,
        max_sequence_length=512,
    )
    request = stage_pb2.StageRequest(request_id="forged", params=params, input=state, outputs=outputs)
    with sync_channel(address) as channel, pytest.raises(grpc.RpcError) as caught:
        list(stage_pb2_grpc.StageStub(channel).Run(request, timeout=30))
    return caught.value


def _real_latents_ref(cluster) -> tensor_pb2.TensorRef:
    import torch

    producer = cluster.transports["dit-denoise"]
    state = producer.export_state({"latents": torch.zeros(1, 16, 64)}, {"height": "64", "width": "64"})
    (ref,) = state.tensors
    assert ref.HasField("shm")
    return ref


def test_forged_handles_are_refused_and_the_stage_serves_on(cluster) -> None:
    decoder = cluster.addresses["vae-decode"]
    ref = _real_latents_ref(cluster)
    try:
        forged_arena = tensor_pb2.TensorRef()
        forged_arena.CopyFrom(ref)
        forged_arena.shm.arena_id = "0123456789abcdef-0"
        forged_offset = tensor_pb2.TensorRef()
        forged_offset.CopyFrom(ref)
        forged_offset.shm.offset += 4096
        forged_lease = tensor_pb2.TensorRef()
        forged_lease.CopyFrom(ref)
        token, slot, _ = ref.shm.lease_id.split("-")
        forged_lease.shm.lease_id = f"{token}-{slot}-{'0' * 15}1"
        traversal = tensor_pb2.TensorRef()
        traversal.CopyFrom(ref)
        traversal.shm.arena_id = "../../etc/passwd"
        cases = [
            (forged_arena, {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED}),
            (forged_offset, {grpc.StatusCode.PERMISSION_DENIED}),
            (forged_lease, {grpc.StatusCode.NOT_FOUND}),
            (traversal, {grpc.StatusCode.INVALID_ARGUMENT}),
        ]
        for forged, codes in cases:
            state = tensor_pb2.StageState(tensors=[forged], meta={"height": "64", "width": "64"})
            err = _stage_run(decoder, state)
            assert err.code() in codes, (forged, err.code(), err.details())
            assert "/dev/shm" not in err.details() and ref.shm.lease_id not in err.details()
    finally:
        cluster.transports["dit-denoise"].release([ref.shm.lease_id])
    with Client(cluster.coordinator) as client:
        assert client.generate("still serving", **SMALL).size == (64, 64)


def test_nan_tensors_are_refused(cluster) -> None:
    import torch

    producer = cluster.transports["dit-denoise"]
    latents = torch.full((1, 16, 64), float("nan"))
    state = producer.export_state({"latents": latents}, {"height": "64", "width": "64"})
    try:
        err = _stage_run(cluster.addresses["vae-decode"], state)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "NaN" in err.details()
    finally:
        producer.release(producer.lease_ids(state))


def test_cancel_mid_denoise_stops_work_and_frees_every_lease(cluster) -> None:
    outcome: list[BaseException] = []
    steps_seen: list[int] = []
    request_id = "cancel-me"

    def run() -> None:
        with Client(cluster.coordinator) as client:
            try:
                for event in client.events("slow", request_id=request_id, **{**SMALL, "steps": 500}):
                    if event.HasField("step"):
                        steps_seen.append(event.step.step)
            except OmniError as err:
                outcome.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 30
    while len(steps_seen) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    with Client(cluster.coordinator) as client:
        assert client.cancel(request_id) is True
    thread.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], Cancelled)
    assert 2 <= max(steps_seen) < 500
    wait_until_no_leases(cluster)
    with Client(cluster.coordinator) as client:
        assert client.cancel(request_id) is False


def test_client_that_goes_away_frees_its_leases(cluster) -> None:
    with Client(cluster.coordinator) as client:
        events = client.events("leaving", **{**SMALL, "steps": 500})
        for event in events:
            if event.HasField("step") and event.step.step == 2:
                break
        events.close()  # cancels the call
    wait_until_no_leases(cluster)


def test_unknown_stage_output_is_invalid_argument(cluster) -> None:
    import torch

    producer = cluster.transports["dit-denoise"]
    state = producer.export_state({"latents": torch.zeros(1, 64, 16)}, {"height": "64", "width": "64"})
    try:
        err = _stage_run(cluster.addresses["vae-decode"], state, outputs=("png", "jpeg"))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "'jpeg'" in err.details()
    finally:
        producer.release(producer.lease_ids(state))
