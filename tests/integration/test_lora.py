"""LoRA adapters through real servers: StageControl's adapter calls, a request's `loras`
through the SDK and the coordinator, the image against diffusers' `load_lora_weights`, batched
requests with different adapters, and bad adapters refused with clean statuses while the
replica keeps serving."""

from __future__ import annotations

import contextlib
import io
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from diffusers import QwenImagePipeline
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel
from PIL import Image
from safetensors.torch import load_file, save_file

from omni_common.client import Client
from omni_common.errors import InvalidArgument, NotFound
from omni_common.models.lora_files import save_random_lora
from omni_common.net.rpc import sync_channel
from omnistage.v1 import stage_pb2, stage_pb2_grpc
from omnistage_cli import main as cli
from tests.integration.conftest import InProcessCluster
from tests.integration.test_concurrency import IMAGE_TOL

SMALL = {"width": 64, "height": 64, "steps": 3}


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Random adapters "a" and "b" to add, and "ondisk" in the DiT's adapter directory."""
    root = tmp_path_factory.mktemp("adapters")
    transformer = QwenImageTransformer2DModel.from_pretrained(tiny_model / "transformer")
    (root / "dir").mkdir()
    return {
        "a": save_random_lora(root / "a.safetensors", transformer, seed=1),
        "b": save_random_lora(root / "b.safetensors", transformer, seed=2, rank=2),
        "ondisk": save_random_lora(root / "dir" / "ondisk.safetensors", transformer, seed=3),
    }


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, adapters: dict[str, Path]) -> Iterator[InProcessCluster]:
    running = InProcessCluster(
        tiny_model, stage_options={"dit-denoise": {"lora_dir": str(adapters["ondisk"].parent)}}
    )
    running.start()
    yield running
    running.stop()


@pytest.fixture
def control(cluster: InProcessCluster) -> Iterator[stage_pb2_grpc.StageControlStub]:
    with sync_channel(cluster.addresses["dit-denoise"]) as channel:
        yield stage_pb2_grpc.StageControlStub(channel)


def add(
    control: stage_pb2_grpc.StageControlStub, name: str, path: Path, **fields: object
) -> stage_pb2.LoraInfo:
    return control.AddLora(stage_pb2.AddLoraRequest(name=name, path=str(path), **fields), timeout=30)  # type: ignore[arg-type]


def generate(cluster: InProcessCluster, seed: int = 3, **kwargs: object) -> np.ndarray:
    with Client(cluster.coordinator) as client:
        result = client.generate_result("a lamp", seed=seed, return_tensor=True, **SMALL, **kwargs)
        return np.asarray(result.tensor)


def wait_for_routing(cluster: InProcessCluster, name: str) -> None:
    """The coordinator learns a replica's adapters from its StageInfo (refreshed every second)."""
    deadline = time.monotonic() + 10
    with Client(cluster.coordinator) as client:
        while time.monotonic() < deadline:
            [model] = client.list_models()
            if name in model.loras:
                assert model.takes_loras
                return
            time.sleep(0.1)
    raise AssertionError(f"the coordinator never listed adapter {name}")


def test_an_adapter_through_the_cluster_equals_diffusers(
    cluster: InProcessCluster,
    control: stage_pb2_grpc.StageControlStub,
    adapters: dict[str, Path],
    tiny_model: Path,
) -> None:
    info = add(control, "a", adapters["a"], scale=0.7)
    assert (info.name, info.rank, info.modules, info.pinned) == ("a", 4, 34, False)
    assert info.scale == pytest.approx(0.7) and info.bytes > 0
    wait_for_routing(cluster, "a")
    image = generate(cluster, loras=[("a", 0.7)])
    assert np.abs(image - generate(cluster)).max() > 1e-3  # the adapter shows

    pipe = QwenImagePipeline.from_pretrained(tiny_model, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(adapters["a"]), adapter_name="a")
    pipe.set_adapters(["a"], [0.7])
    expected = pipe(
        "a lamp",
        width=64,
        height=64,
        num_inference_steps=3,
        true_cfg_scale=1.0,
        generator=torch.Generator().manual_seed(3),
        output_type="pt",
    ).images[0]
    assert np.array_equal(image, expected.numpy())  # bitwise: PEFT's unfused math, fp32, CPU
    # the scale added with is the default: 0.7 here
    assert np.array_equal(generate(cluster, loras=["a"]), image)


def test_requests_with_different_adapters_batch_and_each_equals_its_lone_image(
    cluster: InProcessCluster, control: stage_pb2_grpc.StageControlStub, adapters: dict[str, Path]
) -> None:
    add(control, "a", adapters["a"])
    add(control, "b", adapters["b"])
    wait_for_routing(cluster, "b")
    cases = [
        {"loras": [("a", 0.8)]},
        {"loras": [("b", 1.2), ("a", -0.5)]},
        {"loras": []},
        {"loras": [("b", 0.3)]},
    ]
    alone = [generate(cluster, seed=i, **case) for i, case in enumerate(cases)]
    with ThreadPoolExecutor(len(cases)) as pool:
        together = list(pool.map(lambda item: generate(cluster, seed=item[0], **item[1]), enumerate(cases)))
    for got, expected in zip(together, alone, strict=True):
        np.testing.assert_allclose(got, expected, atol=IMAGE_TOL, rtol=0)
    assert np.abs(alone[0] - alone[2]).max() > 1e-3


def test_adapter_control_calls_and_bad_adapters(
    cluster: InProcessCluster,
    control: stage_pb2_grpc.StageControlStub,
    adapters: dict[str, Path],
    tmp_path: Path,
) -> None:
    add(control, "a", adapters["a"])
    before = generate(cluster, loras=[("a", 1.0)])
    tensors = load_file(str(adapters["a"]))
    key = next(k for k in tensors if k.endswith("to_q.lora_A.weight"))
    save_file({**tensors, key: torch.zeros(4, 5)}, str(tmp_path / "shape.safetensors"))
    save_file(
        {**tensors, key: torch.full_like(tensors[key], float("inf"))}, str(tmp_path / "inf.safetensors")
    )
    save_file(
        {
            **tensors,
            "transformer.nope.lora_A.weight": torch.zeros(4, 4),
            "transformer.nope.lora_B.weight": torch.zeros(4, 4),
        },
        str(tmp_path / "module.safetensors"),
    )
    for name in ("shape", "inf", "module"):
        with pytest.raises(grpc.RpcError) as err:
            add(control, "a", tmp_path / f"{name}.safetensors")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        add(control, "c", tmp_path / "absent.safetensors")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        add(control, "bad/name", adapters["a"])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with sync_channel(cluster.addresses["ar-encoder"]) as channel:
        with pytest.raises(grpc.RpcError) as err:
            add(stage_pb2_grpc.StageControlStub(channel), "a", adapters["a"])
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED

    pinned = control.PinLora(stage_pb2.PinLoraRequest(name="a", pinned=True), timeout=10)
    assert pinned.pinned
    listed = control.ListLoras(stage_pb2.ListLorasRequest(), timeout=10)
    assert "a" in [i.name for i in listed.loras] and listed.max_bytes == 1 << 30
    with pytest.raises(grpc.RpcError) as err:
        control.RemoveLora(stage_pb2.RemoveLoraRequest(name="zzz"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND

    with pytest.raises(NotFound, match="absent"):
        generate(cluster, loras=[("absent", 1.0)])
    with pytest.raises(InvalidArgument, match="twice"):
        generate(cluster, loras=[("a", 1.0), ("a", 2.0)])
    with pytest.raises(InvalidArgument, match="scale"):
        generate(cluster, loras=[("a", float("nan"))])
    assert np.array_equal(generate(cluster, loras=[("a", 1.0)]), before)  # nothing disturbed
    remaining = control.RemoveLora(stage_pb2.RemoveLoraRequest(name="a"), timeout=10)
    assert "a" not in [i.name for i in remaining.loras]


def test_an_adapter_in_the_directory_loads_on_demand(cluster: InProcessCluster, control) -> None:
    image = generate(cluster, loras=[("ondisk", 1.0)])
    assert np.abs(image - generate(cluster)).max() > 1e-3
    assert "ondisk" in [i.name for i in control.ListLoras(stage_pb2.ListLorasRequest(), timeout=10).loras]
    assert np.array_equal(generate(cluster, loras=[("ondisk", 1.0)]), image)


def test_the_command_line_adds_lists_and_uses_adapters(
    cluster: InProcessCluster, adapters: dict[str, Path], tmp_path: Path
) -> None:
    dit = cluster.addresses["dit-denoise"]

    def run(*argv: str) -> str:
        output = io.StringIO()
        with contextlib.redirect_stdout(output):
            assert cli.main(list(argv)) == 0
        return output.getvalue()

    added = json.loads(run("lora", "add", dit, "cli-a", str(adapters["a"]), "--scale", "0.7", "--pin"))
    assert added["name"] == "cli-a" and added["pinned"]
    listed = json.loads(run("lora", "list", dit))
    assert "cli-a" in [item["name"] for item in listed["loras"]]
    wait_for_routing(cluster, "cli-a")
    out = tmp_path / "cli.png"
    size = ["--width", "64", "--height", "64", "--steps", "3", "--seed", "3"]
    run(
        "generate",
        "a lamp",
        "-o",
        str(out),
        "--address",
        cluster.coordinator,
        "--lora",
        "cli-a:0.7",
        "--quiet",
        *size,
    )
    with Client(cluster.coordinator) as client:
        expected = client.generate("a lamp", width=64, height=64, steps=3, seed=3, loras=[("cli-a", 0.7)])
    assert np.array_equal(np.asarray(Image.open(out).convert("RGB")), np.asarray(expected))
    run("lora", "unpin", dit, "cli-a")
    assert "cli-a" not in [
        item.get("name") for item in json.loads(run("lora", "remove", dit, "cli-a")).get("loras", [])
    ]
