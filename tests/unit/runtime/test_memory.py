"""Module discovery from a family's declaration, and sleep/wake round trips on real runners."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from omni_common.models.base import GenerationRequest
from omni_common.models.module_layout import ModuleDeclaration
from omni_common.models.qwenimage.decode import QwenImageDecoder
from omni_common.models.qwenimage.denoise import QwenImageDenoiser
from omni_common.models.qwenimage.encode import QwenImageEncoder
from omni_common.models.qwenimage.family import MODULES
from omni_common.runtime.memory import WeightSleeper, discover_modules

CPU = torch.device("cpu")
REQUEST = GenerationRequest(prompt="a cat", width=32, height=32, num_inference_steps=3, seed=5)


class Runner:
    """A stand-in runner holding plain modules (the discovery rules do not need a model)."""

    def __init__(self) -> None:
        self.net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        self.head = nn.Linear(2, 2)
        self.blocks = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
        self.scale = torch.ones(3)  # a tensor, not a module
        self.name = "runner"


def paths(found: dict[str, list[tuple[str, nn.Module]]]) -> dict[str, list[str]]:
    return {role: [path for path, _ in items] for role, items in found.items()}


def test_declared_modules_resolve_by_role_with_dotted_paths() -> None:
    declaration = ModuleDeclaration(roles={"dit": ("net",), "vae": ("head",), "resident": ("net.0",)})
    found = discover_modules(Runner(), declaration, "dit")
    assert paths(found.by_role) == {"resident": ["net.0"], "dit": ["net"], "vae": ["head"]}


def test_a_declared_path_that_is_not_a_module_is_warned_about_and_skipped(caplog) -> None:
    declaration = ModuleDeclaration(roles={"dit": ("net", "scale", "name")})
    with caplog.at_level(logging.WARNING, "omnistage.memory"):
        found = discover_modules(Runner(), declaration, "dit")
    assert paths(found.by_role) == {"dit": ["net"]}
    assert "scale is Tensor, not a torch module" in caplog.text
    assert "name is str, not a torch module" in caplog.text


def test_modules_listed_twice_or_nested_are_kept_once() -> None:
    declaration = ModuleDeclaration(roles={"dit": ("net", "net", "net.1"), "vae": ("net.0", "head")})
    found = discover_modules(Runner(), declaration, "dit")
    assert paths(found.by_role) == {"dit": ["net"], "vae": ["head"]}
    names = [name for name, _ in found.named_weights()]
    assert len(names) == len(set(names)) == 6  # net: 2 x (weight, bias); head: weight, bias


def test_resident_weights_stay_out_of_what_sleep_moves() -> None:
    declaration = ModuleDeclaration(roles={"dit": ("net",), "resident": ("net.0",)})
    found = discover_modules(Runner(), declaration, "dit")
    assert [name for name, _ in found.named_weights()] == ["net.1.weight", "net.1.bias"]


def test_another_stages_paths_are_skipped_quietly(caplog) -> None:
    declaration = ModuleDeclaration(roles={"dit": ("transformer",), "vae": ("head",)})
    with caplog.at_level(logging.WARNING, "omnistage.memory"):
        found = discover_modules(Runner(), declaration, "vae")
    assert paths(found.by_role) == {"vae": ["head"]} and caplog.text == ""


def test_a_family_that_declares_nothing_gets_its_runner_scanned(caplog) -> None:
    with caplog.at_level(logging.WARNING, "omnistage.memory"):
        found = discover_modules(Runner(), None, "encoder")
    assert paths(found.by_role) == {"encoder": ["blocks", "head", "net"]}
    assert "declares no modules" in caplog.text


def test_layers_must_be_a_module_list(caplog) -> None:
    declaration = ModuleDeclaration(roles={"dit": ("net",)}, layers=("blocks", "head"))
    with caplog.at_level(logging.WARNING, "omnistage.memory"):
        found = discover_modules(Runner(), declaration, "dit")
    assert [path for path, _ in found.layers] == ["blocks"]
    assert "head is a Linear, not a ModuleList" in caplog.text


def test_unknown_roles_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown module roles"):
        ModuleDeclaration(roles={"unet": ("x",)})


def test_the_qwenimage_declaration_covers_every_weight_of_each_stage(tiny_model: Path) -> None:
    runners = {
        "encoder": QwenImageEncoder.load(tiny_model, CPU, torch.float32),
        "dit": QwenImageDenoiser.load(tiny_model, CPU, torch.float32),
        "vae": QwenImageDecoder.load(tiny_model, CPU, torch.float32),
    }
    for role, runner in runners.items():
        found = discover_modules(runner, MODULES, role)
        assert list(found.by_role) == (["resident", "dit"] if role == "dit" else [role])
        model = next(module for _, module in found.by_role[role])
        resident = sum(p.numel() for _, m in found.by_role.get("resident", []) for p in m.parameters())
        moved = sum(t.numel() for _, t in found.named_weights())
        assert moved + resident == sum(t.numel() for t in [*model.parameters(), *model.buffers()])
    assert [path for path, _ in discover_modules(runners["dit"], MODULES, "dit").layers] == [
        "transformer.transformer_blocks"
    ]


def run_denoiser(tiny_model: Path, denoiser: object) -> torch.Tensor:
    encoder = QwenImageEncoder.load(tiny_model, CPU, torch.float32)
    state = denoiser.prepare(REQUEST, encoder.encode([REQUEST])[0])  # type: ignore[attr-defined]
    while not denoiser.is_done(state):  # type: ignore[attr-defined]
        denoiser.step([state])  # type: ignore[attr-defined]
    return state.latents


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_leave_outputs_bitwise_unchanged(tiny_model: Path, level: int) -> None:
    denoiser = QwenImageDenoiser.load(tiny_model, CPU, torch.float32)
    before = run_denoiser(tiny_model, denoiser)
    modules = discover_modules(denoiser, MODULES, "dit")
    total = modules.weight_bytes()

    def reload() -> dict[str, torch.Tensor]:
        fresh = QwenImageDenoiser.load(tiny_model, CPU, torch.float32)
        return dict(discover_modules(fresh, MODULES, "dit").named_weights())

    sleeper = WeightSleeper(modules, CPU, reload=reload)
    slept = sleeper.sleep(level)
    assert (slept.level, slept.nbytes) == (level, total) and not sleeper.awake
    assert slept.copied == (total if level == 1 else 0)
    assert all(t.numel() == 0 for _, t in modules.named_weights())  # the memory is really gone
    assert denoiser.transformer.img_in.weight.numel() > 0  # resident
    assert sleeper.sleep(level).nbytes == 0  # sleeping twice is a no-op
    woken = sleeper.wake()
    assert (woken.level, woken.nbytes) == (level, total) and sleeper.awake
    assert torch.equal(run_denoiser(tiny_model, denoiser), before)
    if level == 1:  # packed: the weights came back as views of one buffer (the tiny model
        # fits one chunk), in one copy
        storages = {t.untyped_storage().data_ptr() for _, t in modules.named_weights()}
        assert len(storages) == 1
    # Weights do not change while served: level 1 kept its host copy, so sleeping again
    # copies nothing; level 2 drops everything again.
    again = sleeper.sleep(level)
    assert (again.nbytes, again.copied) == (total, 0)
    assert sleeper.wake().copied == total
    assert torch.equal(run_denoiser(tiny_model, denoiser), before)


def test_level_two_needs_a_reload() -> None:
    sleeper = WeightSleeper(discover_modules(Runner(), None, "dit"), CPU)
    with pytest.raises(ValueError, match="reload"):
        sleeper.sleep(2)
