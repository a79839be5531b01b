"""vae-decode server: where a request to this stage enters (omni_common.runtime.stage_service
validates, maps tensors and streams events; the worker runs the model)."""

from __future__ import annotations

from omni_common.runtime.config import StageConfig
from omni_common.runtime.serve import run
from omni_common.runtime.stage_service import serve_stage
from services.vae_decode.worker import DecodeWorker


def main(config: StageConfig) -> None:
    run(serve_stage(config, DecodeWorker))
