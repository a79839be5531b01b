"""Where a component's weights come from: a diffusers/transformers directory on disk, or,
for a *random-weights* model directory, the architecture built from its config.json with
seeded random weights directly on the device; and the safetensors files a control call names
(LoRA adapters, pushed weights), checked (checked_files.py).

Random weights serve speed and memory measurements of real-size models on machines whose
disk is smaller than the weights (speed does not depend on the values). A directory is a
random-weights one when it holds RANDOM_WEIGHTS_FILE; its seed makes every process that
builds a component (each stage, and a diffusers baseline) get the same weights.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from omni_common.checked_files import HeaderCheck, confined, read_safetensors_file, shown
from omni_common.errors import NotFound

RANDOM_WEIGHTS_FILE = "random_weights.json"


def random_weights_seed(model_dir: Path) -> int | None:
    """The seed of a random-weights model directory, None for one with real weights."""
    marker = Path(model_dir) / RANDOM_WEIGHTS_FILE
    if not marker.is_file():
        return None
    return int(json.loads(marker.read_text())["seed"])


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _component_seed(seed: int, component: str) -> int:
    """A per-component seed, so components do not depend on the order they are built in."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{component}".encode()).digest()[:4], "little")


@contextmanager
def seeded_build(seed: int, component: str, device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Build a component's random weights inside: seeded per component (the CUDA generators
    too), in place on `device` in `dtype` (a 20 B model never exists in float32)."""
    torch.manual_seed(_component_seed(seed, component))
    with torch.device(device), _default_dtype(dtype):
        yield


def load_component(cls: Any, component_dir: Path, device: torch.device, dtype: torch.dtype) -> Any:
    """A diffusers or transformers model from `component_dir` (e.g. model/transformer), in
    `dtype`, on `device`, in eval mode."""
    component_dir = Path(component_dir)
    seed = random_weights_seed(component_dir.parent)
    if seed is None:
        model = cls.from_pretrained(component_dir, dtype=dtype)
        module: torch.nn.Module = model  # transformers' typed `.to` confuses mypy
        return for_inference(module.to(device))
    with seeded_build(seed, component_dir.name, device, dtype):
        if hasattr(cls, "from_config"):  # diffusers
            model = cls.from_config(cls.load_config(component_dir))
        else:  # transformers
            config = cls.config_class.from_pretrained(component_dir)
            model = cls._from_config(config, dtype=dtype)
    return for_inference(model)


def for_inference(module: Any) -> Any:
    """`module` in eval mode with no parameter that asks for gradients. A served model never
    trains: a forward outside `no_grad` would otherwise record its autograd graph, and whatever
    kept an output (a KV slot written in place, a kept prefix) would keep every activation of
    that forward alive, and through each later write, of the forwards before it."""
    module.eval()
    module.requires_grad_(False)
    return module


def local_path(text: str | Path, what: str, root: Path | None = None) -> Path:
    """A path a control call names on this machine, resolved (inside `root` when there is
    one: checked_files.confined): INVALID_ARGUMENT for one no file system takes (empty, a NUL
    byte, too long), NOT_FOUND when nothing is there or it lies outside the root. What kind
    of file it is gets checked when it is opened (read_safetensors)."""
    path = confined(text, root, what)
    try:
        os.lstat(path)
    except OSError:
        raise NotFound(f"no {what} at {shown(str(text))}") from None
    return path


def safetensors_in(directory: Path, root: Path | None, what: str) -> list[Path]:
    """The `*.safetensors` entries of a directory, sorted, each resolved inside `root` (an
    entry may be a symlink, but not one out of the root); each is checked again as opened."""
    return sorted(confined(str(entry), root, what) for entry in directory.glob("*.safetensors"))


def read_safetensors(
    path: Path, check: HeaderCheck | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and header metadata of a safetensors file, opened checked (a regular file, no
    FIFO can block it) and its header checked (then by `check`) before any tensor is read;
    INVALID_ARGUMENT for anything else."""
    return read_safetensors_file(path, "safetensors file", check)
