"""The one table of stage types, which every layer reads: the stages a model's plan runs on,
the module role each one's runner holds when its family declares none, and the port each one
listens on by default; with the batching defaults that a replica's flags, its runners and its
schedulers share."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageType:
    """One stage type: its name (a service of docker-compose.yml and a `omnistage serve`
    subcommand), its module role (omni_common/models/module_layout.py's MODULE_ROLES) and its gRPC port."""

    name: str
    module_role: str
    port: int


STAGE_TABLE = (
    StageType("ar-encoder", "encoder", 50061),
    StageType("dit-denoise", "dit", 50062),
    StageType("vae-decode", "vae", 50063),
)
STAGES = tuple(stage.name for stage in STAGE_TABLE)
STAGE_MODULE_ROLES = {stage.name: stage.module_role for stage in STAGE_TABLE}

# Requests per forward, and requests waiting or running in one replica, unless --max-batch /
# --max-queue say otherwise.
MAX_BATCH = 8
MAX_QUEUE = 64
# How a replica's generators decode (--ar-decode; models/generation.py's decode_mode).
DECODE_MODES = ("auto", "eager", "graphs")
