"""The DiT worker's execution flags: what `auto` means where, and `on` where it cannot be."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_common.runtime.config import StageConfig
from services.dit_denoise.worker import DenoiseWorker


def config(model: Path, **flags: str) -> StageConfig:
    return StageConfig(stage="dit-denoise", model_dir=model, device="cpu", **flags)  # type: ignore[arg-type]


def test_auto_leaves_graphs_and_compilation_off_on_the_cpu(tiny_model: Path) -> None:
    worker = DenoiseWorker(config(tiny_model))
    try:
        options = worker.denoiser_options()
        assert not options.cuda_graphs and not options.compile
        assert worker.model.graphed is None  # type: ignore[attr-defined]
    finally:
        worker.close()


@pytest.mark.parametrize("flag", ["cuda_graphs", "compile"])
def test_asking_for_them_on_the_cpu_is_refused_at_start(tiny_model: Path, flag: str) -> None:
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        DenoiseWorker(config(tiny_model, **{flag: "on"}))


def test_graphs_on_for_a_family_whose_dit_records_none_is_refused_at_start(glm_model: Path) -> None:
    # auto leaves them off for such a family (on a GPU too: its card says so)
    with pytest.raises(SystemExit, match="glm-image's DiT replays no CUDA graphs"):
        DenoiseWorker(config(glm_model, cuda_graphs="on"))


def test_lora_flags_reach_the_denoiser(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    from omni_common.runtime.config import add_stage_args, stage_config

    monkeypatch.setenv("OMNISTAGE_LORA_DIR", str(tmp_path))  # the environment fallback
    parser = argparse.ArgumentParser()
    add_stage_args(parser, "dit-denoise")
    args = parser.parse_args(
        ["--model", str(tiny_model), "--device", "cpu", "--lora-bytes", "12345", "--lora-batching", "grouped"]
    )
    worker = DenoiseWorker(stage_config("dit-denoise", args))
    try:
        layers = worker.lora_layers()
        assert (layers.max_bytes, layers.directory) == (12345, tmp_path)
        assert worker.model.lora_grouped  # type: ignore[attr-defined]
        assert worker.lora_names() == []
    finally:
        worker.close()


@pytest.mark.parametrize(
    ("precision", "taken"), [("high", "high"), ("highest", "highest"), ("auto", "highest")]
)
def test_the_process_takes_the_stages_float32_matmul_precision(
    tiny_model: Path, precision: str, taken: str
) -> None:
    """The stage's setting becomes the process's; auto is IEEE float32 on the CPU (TF32 on CUDA)."""
    import torch

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")  # neither: the worker sets its own
    try:
        DenoiseWorker(config(tiny_model, float32_matmul_precision=precision)).close()
        assert torch.get_float32_matmul_precision() == taken
    finally:
        torch.set_float32_matmul_precision(before)
