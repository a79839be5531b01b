"""dit-denoise server: where a request to this stage enters (omni_common.runtime.stage_service
validates, maps tensors and streams events; the worker runs the model)."""

from __future__ import annotations

from omni_common.runtime.config import StageConfig
from omni_common.runtime.group_runner import GroupWorker
from omni_common.runtime.serve import run
from omni_common.runtime.stage_service import StageWorker, serve_stage
from services.dit_denoise.worker import DenoiseWorker


def make_worker(config: StageConfig) -> StageWorker:
    """One device in this process, or (--devices) a worker process per device."""
    return GroupWorker(config) if config.devices else DenoiseWorker(config)


def main(config: StageConfig) -> None:
    run(serve_stage(config, make_worker))
