"""The 4th family, chime (tests/families/chime: text to audio, its last role returning the
waveform whole), added by following docs/families.md and registered with one line, served by
real processes: the SDK's reply equals what the family's model computes, bit for bit."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from omni_common.client import Client
from omni_common.cluster import LocalCluster, loopback_plan
from omni_common.errors import OmniError
from tests.families.chime.model import HOP, SAMPLE_RATE, build_tiny_fixture, reference_generate

pytestmark = pytest.mark.slow

# The registry line: every process of the cluster inherits it.
REGISTRATION = {"OMNISTAGE_FAMILIES": "tests.families.chime:ENTRY"}
ROOT = Path(__file__).resolve().parents[2]  # where `tests.families` imports from


@pytest.fixture(scope="module")
def chime_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_fixture(tmp_path_factory.mktemp("models") / "chime-tiny", seed=3)


@pytest.fixture(scope="module")
def chime_cluster(chime_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    # One thread a stage, as the reference runs: CPU float32 kernels round by thread count.
    env = {**REGISTRATION, "PYTHONPATH": path, "OMNISTAGE_THREADS": "1"}
    plan = loopback_plan(chime_model, "float32", env)
    with LocalCluster(plan, log_dir=tmp_path_factory.mktemp("chime-logs")) as cluster:
        yield cluster.coordinator


def reference(model_dir: Path, prompt: str, seed: int, frames: int) -> np.ndarray:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return reference_generate(model_dir, prompt, seed=seed, steps=4, frames=frames).numpy()
    finally:
        torch.set_num_threads(threads)


def test_the_card_says_text_in_audio_out_and_every_role_is_served(chime_cluster: str) -> None:
    with Client(chime_cluster) as client:
        client.wait_ready(model="chime-tiny")  # a replica of each stage: every role served
        (info,) = client.list_models()
    assert (info.name, info.family) == ("chime-tiny", "chime")
    assert list(info.inputs) == ["text"] and list(info.outputs) == ["audio"]
    assert info.ready
    assert {option.name for option in info.options} == {"frames", "audio", "stream_audio"}


@pytest.mark.parametrize(("prompt", "seed", "frames"), [("ding dong", 7, 24), ("a bell at noon", 1, 3000)])
def test_a_spoken_reply_equals_the_model_bitwise(
    chime_cluster: str, chime_model: Path, prompt: str, seed: int, frames: int
) -> None:
    """Short and long (3000 frames: 96,000 samples, more than one AudioChunk's worth)."""
    with Client(chime_cluster) as client:
        reply = client.speak(prompt, seed=seed, options={"frames": frames})
    expected = reference(chime_model, prompt, seed, frames)
    assert reply.sample_rate == SAMPLE_RATE
    assert reply.text == ""
    assert len(reply.audio) == frames * HOP and np.abs(expected).max() > 0
    np.testing.assert_array_equal(reply.audio, expected)


def test_an_option_out_of_range_is_invalid_argument(chime_cluster: str) -> None:
    with Client(chime_cluster) as client, pytest.raises(OmniError, match="frames") as caught:
        client.speak("ding", options={"frames": 0})
    assert caught.value.code.name == "INVALID_ARGUMENT"
