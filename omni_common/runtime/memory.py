"""Which modules a stage holds, by role, and moving their weights off and back on the device.

A model family *declares* its modules (vllm-omni's lesson: discovering them by attribute
names silently leaves multi-GB models idle on the GPU when a name changes). Paths are
dotted and relative to a stage's runner, e.g. "transformer.transformer_blocks". A family
that declares nothing gets a fallback scan of the runner's attributes.

Sleep level 1 copies every weight to (pinned) host memory and frees the device copy; level 2
drops the weights and wake reloads them with the family's loader. Both keep the module
objects, so nothing that holds a reference to them notices. Served weights never change, so
level 1 keeps its host copy after a wake: the next sleep only frees device memory, and a
swap costs one host-to-device copy (the price: host memory for a copy of the weights). The
copy is packed (omni_common.runtime.packing): a wake is a few large copies at the link's
bandwidth, and a sleep hands the memory back to the device (empty_cache), so another
process on the GPU can use it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from omni_common.models.module_layout import MODULE_ROLES as ROLES
from omni_common.models.module_layout import ModuleDeclaration
from omni_common.runtime.packing import Packed, pack_chunks, unpack

log = logging.getLogger("omnistage.memory")


@dataclass(frozen=True)
class StageModules:
    """What discovery found on one runner, each module once: (path, module) per role."""

    by_role: dict[str, list[tuple[str, nn.Module]]]
    layers: list[tuple[str, nn.ModuleList]]

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter and buffer that sleep moves, once, by full dotted path: all
        declared modules' weights except those of resident modules (they stay)."""
        resident = {id(t) for _, m in self.by_role.get("resident", []) for t in _module_tensors(m)}
        seen: set[int] = set()
        for role in ROLES:
            if role == "resident":
                continue
            for path, module in self.by_role.get(role, []):
                for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
                    if id(tensor) not in seen and id(tensor) not in resident:
                        seen.add(id(tensor))
                        yield f"{path}.{name}", tensor

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.named_weights())


def _module_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def _resolve(root: object, path: str) -> object | None:
    """The object at a dotted path, None where a segment is missing."""
    node: object | None = root
    for name in path.split("."):
        node = getattr(node, name, None)
        if node is None:
            return None
    return node


def discover_modules(root: object, declaration: ModuleDeclaration | None, default_role: str) -> StageModules:
    """Resolve `declaration` against a runner.

    A path whose first segment the runner lacks belongs to another stage's runner and is
    skipped quietly; a path that resolves to something other than a module is warned about
    and skipped; a module listed twice, or inside one listed before under a moving role, is
    kept once. Resident modules may sit inside a moving one: their weights stay where they
    are. With no declaration, the runner's module attributes are taken under `default_role`.
    """
    if declaration is None or not declaration.roles:
        found = {name: value for name, value in vars(root).items() if isinstance(value, nn.Module)}
        log.warning(
            "%s declares no modules; found by scanning its attributes: %s",
            type(root).__name__,
            ", ".join(sorted(found)) or "none",
        )
        paths: Mapping[str, tuple[str, ...]] = {default_role: tuple(sorted(found))}
    else:
        paths = declaration.roles
    kept: dict[str, list[nn.Module]] = {"moving": [], "resident": []}
    by_role: dict[str, list[tuple[str, nn.Module]]] = {}
    for role in ("resident", *[r for r in ROLES if r != "resident"]):
        group = kept["resident" if role == "resident" else "moving"]
        for path in paths.get(role, ()):
            module = _module_at(root, path)
            if module is None:
                continue
            if any(module is other or _contains(other, module) for other in group):
                log.debug("module %s is already declared; kept once", path)
                continue
            group.append(module)
            by_role.setdefault(role, []).append((path, module))
    layers = []
    for path in declaration.layers if declaration else ():
        module = _module_at(root, path)
        if isinstance(module, nn.ModuleList):
            layers.append((path, module))
        elif module is not None:
            log.warning(
                "layers %s is a %s, not a ModuleList; not offloaded layerwise", path, type(module).__name__
            )
    return StageModules(by_role, layers)


def _module_at(root: object, path: str) -> nn.Module | None:
    if getattr(root, path.split(".")[0], None) is None:
        return None  # another stage's module
    node = _resolve(root, path)
    if not isinstance(node, nn.Module):
        log.warning("declared module %s is %s, not a torch module; skipped", path, type(node).__name__)
        return None
    return node


def _contains(parent: nn.Module, child: nn.Module) -> bool:
    return any(child is module for module in parent.modules())


@dataclass(frozen=True)
class Transition:
    """What a sleep or wake did: the level, weight bytes freed on or put back onto the device,
    bytes actually copied between host and device, and seconds taken."""

    level: int
    nbytes: int
    seconds: float
    copied: int = 0


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device) -> None:
    """Give freed device memory back to the driver: PyTorch's allocator would keep it cached
    for this process, out of reach of the other processes on the GPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


class WeightSleeper:
    """Sleep and wake of one stage's modules. The caller makes sure no forward runs meanwhile.

    Tensors that hold nothing on the device (blocks a layerwise offload keeps on the host)
    are left alone.
    """

    def __init__(
        self,
        modules: StageModules,
        device: torch.device,
        reload: Callable[[], Mapping[str, torch.Tensor]] | None = None,
    ) -> None:
        self.modules = modules
        self.device = device
        self.reload = reload  # level 2: full-path name -> weights, from the family's loader
        self.level = 0  # 0 = awake
        # Level 1: the weights packed in host memory, kept across wakes (they never change).
        self._host: list[Packed] | None = None
        self._moved: list[str] = []

    @property
    def awake(self) -> bool:
        return self.level == 0

    def sleep(self, level: int) -> Transition:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, not {level}")
        if level == 2 and self.reload is None:
            raise ValueError("sleep level 2 needs a way to reload the weights")
        if not self.awake:
            return Transition(0, 0, 0.0)
        started = time.perf_counter()
        # Tensors that hold nothing on the device (blocks offloaded layerwise) stay as they are.
        weights = [(name, tensor) for name, tensor in self.modules.named_weights() if tensor.numel()]
        nbytes = sum(tensor.numel() * tensor.element_size() for _, tensor in weights)
        copied = 0
        if level == 2:
            self._host = None
        elif self._host is None:
            self._host = pack_chunks([tensor for _, tensor in weights], pin=self.device.type == "cuda")
            copied = nbytes
        for name, tensor in weights:
            self._moved.append(name)
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        _release(self.device)
        self.level = level
        return Transition(level, nbytes, time.perf_counter() - started, copied)

    def wake(self) -> Transition:
        if self.awake:
            return Transition(0, 0, 0.0)
        started = time.perf_counter()
        level = self.level
        if level == 1:
            assert self._host is not None
            unpack(self._host, self.device)
            nbytes = sum(item.nbytes for _, layout in self._host for item in layout)
        else:
            source = self._reloaded()
            current = dict(self.modules.named_weights())
            nbytes = 0
            for name in self._moved:
                current[name].data = source[name].to(self.device, non_blocking=True)
                nbytes += source[name].numel() * source[name].element_size()
        _synchronize(self.device)
        self._moved = []
        self.level = 0
        return Transition(level, nbytes, time.perf_counter() - started, nbytes)

    def drop_host_copy(self) -> None:
        """Free the host copy an awake stage keeps for its next sleep (host memory is short)."""
        if self.awake:
            self._host = None

    def _reloaded(self) -> Mapping[str, torch.Tensor]:
        assert self.reload is not None
        weights = self.reload()
        missing = [name for name in self._moved if name not in weights]
        if missing:
            raise RuntimeError(f"reloaded weights lack {len(missing)} tensors, e.g. {missing[0]}")
        return weights
