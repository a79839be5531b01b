"""A stage replica's LoRA adapters: StageControl's calls (AddLora, RemoveLora, PinLora,
ListLoras) and a request's adapters read from the adapter directory before it is prepared, on
the runner that takes them (capabilities.TakesLoras). The worker (worker.py) provides the
model, the file reader and the compute thread."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from omni_common.checked_files import FileReader
from omni_common.errors import Unimplemented
from omni_common.models.base import ModelFamily, StageModel
from omni_common.models.capabilities import TakesLoras
from omni_common.models.lora import LoraInfo, LoraLayers
from omni_common.models.lora_files import check_name

T = TypeVar("T")
log = logging.getLogger("omnistage.worker")


class LoraControl:
    """The LoRA calls of a worker, which sets these attributes and runs `compute`."""

    stage: str
    family: ModelFamily
    model: StageModel
    files: FileReader
    control_root: Path | None

    async def compute(self, fn: Callable[..., T], *args: object) -> T:
        """Run model work on the device's compute thread (the worker's)."""
        raise NotImplementedError

    def lora_layers(self) -> LoraLayers:
        """The adapters of the runner that takes them; UNIMPLEMENTED when none does."""
        for runner in self.model.runners.values():
            if isinstance(runner, TakesLoras):
                return runner.loras
        raise Unimplemented(f"this {self.stage} replica's model ({self.family.name}) takes no LoRA adapters")

    def lora_names(self) -> list[str]:
        """Adapters loaded here (StageInfo.loras); any thread."""
        try:
            return list(self.lora_layers().names)
        except Unimplemented:
            return []

    async def preload_loras(self, names: Sequence[str]) -> None:
        """Read a request's adapters that are not loaded yet from the adapter directory, on the
        file reader, and install them between steps: the compute thread never opens a file a
        public request named (prepare's acquire then finds them loaded)."""
        try:
            layers = self.lora_layers()
        except Unimplemented:  # a stage whose model takes none (the encoder, the VAE)
            return
        for name in names:
            if name not in layers.names:
                adapter = await self.files.run(layers.read_from_directory, name)
                await self.compute(layers.install_if_absent, adapter)

    async def add_lora(self, name: str, path: str, scale: float, pinned: bool) -> LoraInfo:
        """Read and check the file on the file reader, then install it between steps."""
        layers = self.lora_layers()
        adapter = await self.files.run(
            layers.read, check_name(name), Path(path), scale, pinned, self.control_root
        )
        info = await self.compute(layers.put, adapter)
        log.info(
            "%s: LoRA %s added (%s, %d modules, %d bytes)",
            self.stage,
            name,
            info.source,
            info.modules,
            info.nbytes,
        )
        return info

    async def remove_lora(self, name: str) -> None:
        await self.compute(self.lora_layers().remove, name)
        log.info("%s: LoRA %s removed", self.stage, name)

    async def pin_lora(self, name: str, pinned: bool) -> LoraInfo:
        return await self.compute(self.lora_layers().pin, name, pinned)

    async def list_loras(self) -> tuple[list[LoraInfo], int, int]:
        """(adapters, bytes they take, the bound)."""
        layers = self.lora_layers()
        return await self.compute(lambda: (layers.infos(), layers.nbytes, layers.max_bytes))
