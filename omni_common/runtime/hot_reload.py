"""Weights replaced while a stage serves (StageControl.LoadWeights): an RL trainer pushes new
weights, whole or a part of them, and the next step runs on them.

The new tensors are read and checked off the compute thread (every name must be a weight of
the stage's model, with its shape, finite), then copied in place on the compute thread, which
runs them between two steps: no forward sees half of them. In place keeps every tensor's
device address, so captured CUDA graphs replay on the new values and compiled code (which takes
the weights as inputs) needs no recompile. A request in flight runs its remaining steps on the
new weights; requests that start after the call run on them alone.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from omni_common.checked_files import SafetensorsHeader, is_directory
from omni_common.errors import FailedPrecondition, InvalidArgument
from omni_common.execution.fp8 import FP8_DTYPES
from omni_common.models.weights import local_path, read_safetensors, safetensors_in


@dataclass(frozen=True)
class WeightsLoaded:
    """What one LoadWeights did: tensors and bytes copied, seconds the copy took."""

    tensors: int
    nbytes: int
    seconds: float


def weight_files(paths: Sequence[str], root: Path | None = None) -> list[Path]:
    """The safetensors files of `paths` (files, or directories whose *.safetensors are all
    taken, sorted), resolved inside `root` when there is one; NOT_FOUND for a path that does
    not exist (or lies outside the root), INVALID_ARGUMENT for none."""
    if not paths:
        raise InvalidArgument("LoadWeights names no files")
    what = "weights file or directory"
    files: list[Path] = []
    for text in paths:
        path = local_path(text, what, root)
        if is_directory(path):
            found = safetensors_in(path, root, what)
            if not found:
                raise InvalidArgument(f"directory {path.name!r} holds no .safetensors files")
            files.extend(found)
        else:
            files.append(path)
    return files


Shapes = Mapping[str, tuple[int, ...]]


def weight_shapes(modules: Sequence[tuple[str, nn.Module]]) -> dict[str, tuple[int, ...]]:
    """Each weight's name as LoadWeights names it (planned_copies), and its shape."""
    return {name: tuple(tensor.shape) for name, tensor in _targets(modules).items()}


def _check_header(header: SafetensorsHeader, shapes: Shapes) -> None:
    """Names and shapes from a file's header, before its tensors are read: a file's size is
    then bounded by the model's own (an unknown or larger tensor is refused unread)."""
    for name, entry in header.tensors.items():
        shape = shapes.get(name)
        if shape is None:
            raise InvalidArgument(f"{name[:120]!r} is no weight of this stage's model")
        if entry.shape != shape:
            raise InvalidArgument(
                f"weight {name[:120]!r} has shape {list(entry.shape)}; the model's is {list(shape)}"
            )


def read_weights(
    paths: Sequence[str], shapes: Shapes | None = None, root: Path | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of the files, by name, each file's header checked against `shapes` before
    its tensors are read; a name in two files is INVALID_ARGUMENT."""
    tensors: dict[str, torch.Tensor] = {}
    check = None if shapes is None else (lambda header: _check_header(header, shapes))
    for file in weight_files(paths, root):
        found, _ = read_safetensors(file, check)
        twice = tensors.keys() & found.keys()
        if twice:
            raise InvalidArgument(f"weight {sorted(twice)[0][:120]!r} appears in more than one file")
        tensors.update(found)
    return tensors


def _targets(modules: Sequence[tuple[str, nn.Module]]) -> dict[str, torch.Tensor]:
    targets: dict[str, torch.Tensor] = {}
    for path, module in modules:
        prefix = "" if len(modules) == 1 else f"{path}."
        for name, tensor in module.state_dict(keep_vars=True).items():
            targets[prefix + name] = tensor
    return targets


def planned_copies(
    modules: Sequence[tuple[str, nn.Module]], tensors: dict[str, torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination, source) pairs after checking everything: names are the module's own
    state-dict names when the stage has one module, else prefixed with its declared path.
    INVALID_ARGUMENT for an unknown name, a shape that differs, a non-float or NaN/Inf tensor."""
    if not tensors:
        raise InvalidArgument("the weight files hold no tensors")
    targets = _targets(modules)
    pairs = []
    for name, source in tensors.items():
        target = targets.get(name)
        if target is None:
            raise InvalidArgument(f"{name[:120]!r} is no weight of this stage's model")
        if tuple(source.shape) != tuple(target.shape):
            raise InvalidArgument(
                f"weight {name[:120]!r} has shape {list(source.shape)}; the model's is {list(target.shape)}"
            )
        if target.dtype in FP8_DTYPES:
            raise FailedPrecondition(
                f"weight {name[:120]!r} is quantised to FP8 here (--quantization fp8); LoadWeights "
                "needs a replica that keeps the model dtype"
            )
        if source.is_floating_point() != target.is_floating_point():
            raise InvalidArgument(
                f"weight {name[:120]!r} has dtype {source.dtype}; the model's is {target.dtype}"
            )
        if source.is_floating_point() and not bool(torch.isfinite(source).all()):
            raise InvalidArgument(f"weight {name[:120]!r} has NaN or Inf values")
        pairs.append((target, source))
    return pairs


@torch.no_grad()
def copy_weights(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> WeightsLoaded:
    """Copy each source into its destination in place (cast to its dtype), on the compute thread."""
    started = time.perf_counter()
    nbytes = 0
    for target, source in pairs:
        target.data.copy_(source.to(target.device, target.dtype))
        nbytes += target.numel() * target.element_size()
    if pairs and pairs[0][0].device.type == "cuda":
        torch.cuda.synchronize(pairs[0][0].device)
    return WeightsLoaded(len(pairs), nbytes, time.perf_counter() - started)
