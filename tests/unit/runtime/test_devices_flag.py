"""--devices / --gpus: the device list of a dit-denoise replica over several devices, and of a
vae-decode replica that decodes large images over several."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from omni_common.runtime.config import StageConfig, add_stage_args, parse_devices, stage_config
from omni_common.runtime.group_runner import GroupWorker


def test_gpus_is_shorthand_for_the_first_n_gpus() -> None:
    assert parse_devices("", 2) == ("cuda:0", "cuda:1")
    assert parse_devices("", 0) == parse_devices("", 1) == ()


def test_a_device_list_is_kept_in_order() -> None:
    assert parse_devices("cuda:1, cuda:0", 0) == ("cuda:1", "cuda:0")
    assert parse_devices("cpu,cpu,cpu", 0) == ("cpu", "cpu", "cpu")  # gloo ranks on one CPU


@pytest.mark.parametrize(
    ("text", "gpus", "message"),
    [
        ("cuda:0", 0, "use --device cuda:0"),
        ("cuda:0,cuda:0", 0, "names a GPU twice"),
        ("cpu,cuda:0", 0, "mixes the CPU and GPUs"),
        ("gpu0,gpu1", 0, "cpu or cuda:N"),
        ("cuda,cuda", 0, "cpu or cuda:N"),
        ("cuda:0,cuda:1", 2, "not both"),
    ],
)
def test_a_bad_device_list_stops_with_a_clear_message(text: str, gpus: int, message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        parse_devices(text, gpus)


def test_the_environment_sets_the_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNISTAGE_DEVICES", "cpu,cpu")
    parser = argparse.ArgumentParser()
    add_stage_args(parser, "dit-denoise")
    config = stage_config("dit-denoise", parser.parse_args(["--model", "/models/x"]))
    assert config.devices == ("cpu", "cpu")


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has the GPUs")
def test_a_replica_over_gpus_the_machine_lacks_stops_before_starting_workers(tiny_model: Path) -> None:
    config = StageConfig(stage="dit-denoise", model_dir=tiny_model, devices=("cuda:0", "cuda:1"))
    with pytest.raises(SystemExit, match="needs 2 GPUs; this machine has"):
        GroupWorker(config)


def vae_decode_config(*flags: str) -> StageConfig:
    parser = argparse.ArgumentParser()
    add_stage_args(parser, "vae-decode")
    return stage_config("vae-decode", parser.parse_args(["--model", "/models/x", *flags]))


def test_a_vae_decode_over_devices_runs_on_the_first_and_splits_large_images() -> None:
    config = vae_decode_config("--devices", "cpu,cpu", "--split-decode-pixels", "1000")
    assert config.devices == ("cpu", "cpu") and config.device == "cpu"
    assert config.split_decode_pixels == 1000
    with pytest.raises(SystemExit, match="--device cuda:1 is not the first of --devices cuda:0,cuda:1"):
        vae_decode_config("--devices", "cuda:0,cuda:1", "--device", "cuda:1")


def test_the_encoder_runs_on_one_device() -> None:
    parser = argparse.ArgumentParser()
    add_stage_args(parser, "ar-encoder")
    with pytest.raises(SystemExit, match="are for dit-denoise and vae-decode"):
        stage_config("ar-encoder", parser.parse_args(["--model", "/models/x", "--devices", "cpu,cpu"]))
