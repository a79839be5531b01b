"""Layerwise offload: a model's blocks live in host memory and visit the device one at a time.

Each block's weights are packed into one pinned host buffer, so bringing a block in is a
single large copy. Two device slots take turns: while block i computes from one slot, block
i+1 is copied into the other on a side CUDA stream. A slot is overwritten only after the
compute stream has finished the block that used it (an event), so no allocator is involved
and transfer overlaps compute. The rest of the model (the resident set: embeddings, norms,
projections) stays on the device. Peak weight memory is the resident set plus two blocks.

On a CPU device the same code runs without a stream, and a block's weights are really
dropped and copied back, so CI exercises the whole path.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from omni_common.runtime.packing import PackedTensor, pack


class LayerwiseOffload:
    """Streams the blocks of one ModuleList through the device. `close()` puts them back."""

    def __init__(self, blocks: nn.ModuleList, device: torch.device) -> None:
        self.blocks = list(blocks)
        self.device = device
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.bytes_moved = 0  # host-to-device bytes since construction
        self._host: list[tuple[torch.Tensor, list[PackedTensor]]] = []
        for block in self.blocks:
            host, layout = pack([*block.parameters(), *block.buffers()], pin=cuda)
            for item in layout:
                _drop(item.tensor, device)
            self._host.append((host, layout))
        slot_bytes = max((host.numel() for host, _ in self._host), default=0)
        self._slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
        # slot -> event recorded on the compute stream after the block in that slot ran
        self._slot_free: list[torch.cuda.Event | None] = [None, None]
        self._ready: dict[int, torch.cuda.Event | None] = {}  # block -> its copy finished
        self._slot_of: dict[int, int] = {}  # block on the device -> its slot
        self._next_slot = 0  # slots alternate in fetch order (an odd block count wraps too)
        self._hooks: list[RemovableHandle] = []
        for index, block in enumerate(self.blocks):
            self._hooks.append(block.register_forward_pre_hook(self._before(index)))
            self._hooks.append(block.register_forward_hook(self._after(index)))

    @property
    def block_bytes(self) -> int:
        """Weight bytes of the largest block."""
        return max((sum(item.nbytes for item in layout) for _, layout in self._host), default=0)

    def _fetch(self, index: int) -> None:
        """Start copying block `index` into its slot (on the side stream when there is one)."""
        if index in self._ready:
            return
        number = self._slot_of[index] = self._next_slot
        self._next_slot = 1 - number
        slot = self._slots[number]
        host, layout = self._host[index]
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            free = self._slot_free[number]
            if self.stream is not None and free is not None:
                self.stream.wait_event(free)  # the block that used this slot has run
            slot[: host.numel()].copy_(host, non_blocking=True)
            for item in layout:
                item.tensor.data = item.view(slot)
            self.bytes_moved += sum(item.nbytes for item in layout)
            event = None
            if self.stream is not None:
                event = torch.cuda.Event()
                event.record(self.stream)
        self._ready[index] = event

    def _before(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self._fetch(index)
            event = self._ready[index]
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)
            self._fetch((index + 1) % len(self.blocks))  # overlaps this block's compute

        return hook

    def _after(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            number = self._slot_of.pop(index)
            if self.stream is not None:
                done = torch.cuda.Event()
                done.record(torch.cuda.current_stream(self.device))
                self._slot_free[number] = done
            for item in self._host[index][1]:
                _drop(item.tensor, self.device)
            self._ready.pop(index, None)

        return hook

    def close(self) -> None:
        """Remove the hooks and put every block back on the device for good."""
        for handle in self._hooks:
            handle.remove()
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        for host, layout in self._host:
            for item in layout:
                item.tensor.data = item.view(host).to(self.device)
        self._hooks, self._host, self._ready, self._slots = [], [], {}, []


def _drop(tensor: torch.Tensor, device: torch.device) -> None:
    tensor.data = torch.empty(0, dtype=tensor.dtype, device=device)
