"""Runners have the capabilities (models/capabilities.py) that the worker and the scheduler ask
for by isinstance: the real runners of Qwen-Image and Qwen2.5-Omni on their tiny fixtures, and
an object that has a capability's members without naming the protocol."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from omni_common.models import capabilities
from omni_common.models.base import StageContext
from omni_common.models.qwen_omni.family import QwenOmniFamily
from omni_common.stages import STAGES

CPU = torch.device("cpu")
CAPABILITIES = [
    getattr(capabilities, name)
    for name in (
        "CachesFromWeights",
        "ConfiguresExecution",
        "ExportsPrefixes",
        "HasIdleWork",
        "HoldsCudaGraphs",
        "SplitsCfgBranches",
        "SpreadsForwards",
        "StreamingRunner",
        "SupportsPrefixCache",
        "TakesLoras",
    )
]


def capabilities_of(runner: object) -> set[str]:
    return {capability.__name__ for capability in CAPABILITIES if isinstance(runner, capability)}


def test_the_qwenimage_denoiser_takes_loras_works_while_idle_and_splits_its_cfg_branches(
    split_runners: Callable[[torch.dtype], tuple[Any, Any, Any]],
) -> None:
    encoder, denoiser, decoder = split_runners(torch.float32)
    assert capabilities_of(denoiser) == {
        "CachesFromWeights",
        "ConfiguresExecution",
        "HasIdleWork",
        "HoldsCudaGraphs",
        "SplitsCfgBranches",
        "SpreadsForwards",
        "TakesLoras",
    }
    assert capabilities_of(encoder) == {"HoldsCudaGraphs"}
    assert "StreamingRunner" not in capabilities_of(decoder)
    assert "TakesLoras" not in capabilities_of(decoder)


def test_the_qwen_omni_roles_stream_and_the_thinker_keeps_a_prefix_cache(omni_model: Path) -> None:
    family = QwenOmniFamily()
    context = StageContext(device=CPU, dtype=torch.float32)
    runners = {
        role: runner
        for stage in STAGES
        for role, runner in family.load(stage, omni_model, context).runners.items()
    }
    assert set(runners) == {"thinker", "talker", "token2wav", "vocoder"}
    assert all(isinstance(runner, capabilities.StreamingRunner) for runner in runners.values())
    assert {"SupportsPrefixCache", "CachesFromWeights"} <= capabilities_of(runners["thinker"])
    assert "ExportsPrefixes" in capabilities_of(runners["thinker"])
    assert not any(isinstance(runner, capabilities.TakesLoras) for runner in runners.values())
    # Ahead while idle, the generators record their graphed decode steps, token2wav and the
    # vocoder their common windows' graphs and compile (nothing off CUDA).
    idle = {role for role, runner in runners.items() if isinstance(runner, capabilities.HasIdleWork)}
    assert idle == {"thinker", "talker", "token2wav", "vocoder"}
    assert all(runners[role].idle_work_left() == 0 for role in idle)  # type: ignore[attr-defined]


class Warmer:
    """Idle work by its members alone (a runner need not name the protocol)."""

    def __init__(self) -> None:
        self.left = 2

    def idle_work(self) -> bool:
        self.left -= 1
        return self.left >= 0

    def idle_work_left(self) -> int:
        return max(self.left, 0)


def test_a_capability_is_had_by_its_members_not_by_naming_it() -> None:
    assert capabilities_of(Warmer()) == {"HasIdleWork"}
    assert capabilities_of(object()) == set()
