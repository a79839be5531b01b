"""LoRA adapter files: their names and scales, where an adapter's file lies, what it holds
(PEFT's alpha; factors checked against the model's linear layers), and a random one written in
diffusers' key format for tests and benchmarks. lora.py applies loaded adapters."""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from omni_common.checked_files import is_directory
from omni_common.errors import InvalidArgument
from omni_common.limits import MAX_LORA_SCALE
from omni_common.models.weights import local_path, safetensors_in

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# PEFT's and diffusers' file name in an adapter directory.
LORA_FILE = "pytorch_lora_weights.safetensors"
A_SUFFIX, B_SUFFIX = ".lora_A.weight", ".lora_B.weight"

# A reader turns an adapter file's tensors into diffusers' keys relative to the adapted module
# (`<path>.lora_A.weight` / `.lora_B.weight`), with any alpha already folded into them.
Reader = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def check_name(name: str) -> str:
    """An adapter name: 1-64 letters, digits, '.', '_' or '-', not starting with a dot (it also
    names a file in the adapter directory, so no path can hide in it)."""
    if not NAME_PATTERN.fullmatch(name):
        raise InvalidArgument(
            f"adapter name {name[:80]!r} is invalid: use 1-64 letters, digits, '.', '_' or '-'"
        )
    return name


def check_scale(scale: float, what: str = "adapter scale") -> float:
    """A LoRA scale within the one limit requests and AddLora share (omni_common/limits.py)."""
    if not math.isfinite(scale) or abs(scale) > MAX_LORA_SCALE:
        raise InvalidArgument(
            f"{what} is {scale}; it must be finite, in [-{MAX_LORA_SCALE:g}, {MAX_LORA_SCALE:g}]"
        )
    return scale


def adapter_file(path: Path, root: Path | None = None) -> Path:
    """The safetensors file of an adapter, resolved inside `root` when there is one: the file
    itself, or in a directory PEFT's `pytorch_lora_weights.safetensors` or its only
    `*.safetensors`. What the file is gets checked when it is opened (a FIFO named like an
    adapter never blocks: checked_files.open_regular)."""
    what = "LoRA adapter file or directory"
    path = local_path(path, what, root)
    if not is_directory(path):
        return path
    found = safetensors_in(path, root, what)
    preferred = [p for p in found if p.name == LORA_FILE]
    if preferred or len(found) == 1:
        return (preferred or found)[0]
    raise InvalidArgument(f"adapter directory {path.name!r} holds {len(found)} .safetensors files; name one")


def lora_alpha(metadata: dict[str, str]) -> float | None:
    """PEFT's lora_alpha from a diffusers-saved file's `lora_adapter_metadata`; None when the
    file carries none (diffusers then takes alpha = each module's rank: a scaling of 1)."""
    text = metadata.get("lora_adapter_metadata")
    if not text:
        return None
    try:
        config = json.loads(text)
        if config.get("rank_pattern") or config.get("alpha_pattern"):
            raise InvalidArgument("adapters with per-module rank or alpha patterns are not supported")
        if config.get("use_dora") or config.get("use_rslora"):
            raise InvalidArgument("DoRA and rsLoRA adapters are not supported")
        alpha = config["lora_alpha"]
        if not isinstance(alpha, int | float) or not math.isfinite(alpha):
            raise ValueError(alpha)
        return alpha
    except (ValueError, KeyError, TypeError):
        raise InvalidArgument("the adapter's lora_adapter_metadata is malformed") from None


@dataclass(eq=False)
class LoraAdapter:
    """One loaded adapter: (lora_A, lora_B) per adapted module path, on the model's device."""

    name: str
    source: str
    scale: float  # the default scale of requests that name none
    lora_alpha: float | None  # None: each module's rank (scaling 1 x scale)
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]]
    nbytes: int
    rank: int
    pinned: bool = False
    users: int = 0  # requests holding it (acquire / release)
    last_used: float = field(default_factory=time.monotonic)


def checked_layers(
    name: str,
    tensors: dict[str, torch.Tensor],
    targets: Mapping[str, torch.nn.Linear],
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """An adapter's (lora_A, lora_B) per module path, checked against the model's linear layers
    `targets` (module, shapes, float, finite) and moved to `device` in `dtype`; INVALID_ARGUMENT
    for anything this implementation does not apply."""
    if not tensors:
        raise InvalidArgument(f"adapter {name!r} holds no LoRA weights for this model")
    paths = set()
    for key in tensors:
        if key.endswith(A_SUFFIX):
            paths.add(key.removesuffix(A_SUFFIX))
        elif key.endswith(B_SUFFIX):
            paths.add(key.removesuffix(B_SUFFIX))
        else:
            raise InvalidArgument(f"adapter {name!r}: {key[:120]!r} is no lora_A/lora_B weight")
    layers = {}
    for path in sorted(paths):
        module = targets.get(path)
        if module is None:
            raise InvalidArgument(
                f"adapter {name!r} names module {path[:120]!r}, which this model has no linear layer at"
            )
        a, b = tensors.get(path + A_SUFFIX), tensors.get(path + B_SUFFIX)
        if a is None or b is None:
            raise InvalidArgument(f"adapter {name!r}: module {path!r} lacks its lora_A or lora_B")
        rank = a.shape[0] if a.ndim == 2 else -1
        if (
            a.ndim != 2
            or b.ndim != 2
            or a.shape[1] != module.in_features
            or b.shape != (module.out_features, rank)
        ):
            raise InvalidArgument(
                f"adapter {name!r}: module {path!r} takes lora_A [r, {module.in_features}] and lora_B "
                f"[{module.out_features}, r]; the file has {list(a.shape)} and {list(b.shape)}"
            )
        if not a.is_floating_point() or not b.is_floating_point():
            raise InvalidArgument(f"adapter {name!r}: module {path!r} has non-float weights")
        if not bool(torch.isfinite(a).all()) or not bool(torch.isfinite(b).all()):
            raise InvalidArgument(f"adapter {name!r}: module {path!r} has NaN or Inf weights")
        layers[path] = (
            a.to(device, dtype).contiguous(),
            b.to(device, dtype).contiguous(),
        )
    return layers


def save_random_lora(
    path: Path,
    root: torch.nn.Module,
    *,
    prefix: str = "transformer.",
    rank: int = 4,
    seed: int = 0,
    std: float = 0.05,
    modules: Sequence[str] | None = None,
) -> Path:
    """A random adapter for every linear layer of `root` (or those in `modules`), written in
    diffusers' key format (`<prefix><module>.lora_A.weight` / `.lora_B.weight`, fp32): test
    fixtures and benchmarks, offline. Both factors are random (PEFT would start lora_B at zero)."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in root.named_modules():
        if not isinstance(module, torch.nn.Linear) or (modules is not None and name not in modules):
            continue
        a = torch.randn(rank, module.in_features, generator=generator) * std
        b = torch.randn(module.out_features, rank, generator=generator) * std
        tensors[f"{prefix}{name}{A_SUFFIX}"], tensors[f"{prefix}{name}{B_SUFFIX}"] = a, b
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path
