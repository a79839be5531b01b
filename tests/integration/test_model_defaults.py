"""A model's own defaults (its directory's omnistage.json) on a real cluster: ListModels shows
them, and whatever a request leaves out takes them, from the SDK, the CLI and the gateway."""

from __future__ import annotations

import base64
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image

from omni_common.client import Client
from omni_common.models.model_defaults import ModelDefaults, write_model_defaults
from omnistage_cli.main import main as cli

from .conftest import InProcessCluster, InProcessGateway

OWN = ModelDefaults({"width": 32, "height": 48, "num_inference_steps": 3, "true_cfg_scale": 1})


@pytest.fixture(scope="module")
def small(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessCluster]:
    """The tiny model under another name, with defaults of its own."""
    model = tmp_path_factory.mktemp("models") / "tiny-with-defaults"
    shutil.copytree(tiny_model, model)
    write_model_defaults(model, OWN)
    running = InProcessCluster(model)
    running.start()
    yield running
    running.stop()


def test_list_models_shows_the_models_own_defaults_over_the_familys(small: InProcessCluster) -> None:
    with Client(small.coordinator) as client:
        (model,) = client.list_models()
    assert model.name == "tiny-with-defaults"
    assert dict(model.defaults) == {**OWN.fields, "max_sequence_length": 512}


def test_a_request_that_leaves_fields_out_takes_the_models_defaults(
    small: InProcessCluster, tmp_path: Path
) -> None:
    with Client(small.coordinator) as client:
        steps = [e.step.total for e in client.events("x", seed=1) if e.HasField("step")]
        assert steps and set(steps) == {3}
        assert client.generate("x", seed=1).size == (32, 48)
        assert client.generate("x", seed=1, width=64).size == (64, 48)  # given fields stay
    out = tmp_path / "cli.png"
    assert cli(["generate", "x", "-o", str(out), "--address", small.coordinator, "--quiet"]) == 0
    assert Image.open(out).size == (32, 48)


def test_the_gateway_leaves_an_omitted_size_to_the_model(small: InProcessCluster) -> None:
    gateway = InProcessGateway(small.loop, small.coordinator)
    try:
        response = httpx.post(f"{gateway.url}/v1/images/generations", json={"prompt": "x"}, timeout=60)
        assert response.status_code == 200, response.text
        item = response.json()["data"][0]
        assert item["size"] == "32x48"
        assert base64.b64decode(item["b64_json"]).startswith(b"\x89PNG")
    finally:
        gateway.stop()
