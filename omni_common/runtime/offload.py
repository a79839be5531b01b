"""Layerwise offload: a model's blocks live in host memory and visit the device one at a time.

Before block i runs, its weights are on the device (copied ahead of time) and the copy of
block i+1 starts on a side CUDA stream, so transfer overlaps compute; after block i ran,
its device copy is dropped. The rest of the model (the resident set: embeddings, norms,
projections) stays on the device. Peak weight memory is the resident set plus two blocks.

On a CPU device the same hooks run without a stream, and a block's weights are really
dropped and copied back, so CI exercises the whole path.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


class LayerwiseOffload:
    """Streams the blocks of one ModuleList through the device. `close()` puts them back."""

    def __init__(self, blocks: nn.ModuleList, device: torch.device) -> None:
        self.blocks = list(blocks)
        self.device = device
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.bytes_moved = 0  # host-to-device bytes since construction
        self.seconds_waiting = 0.0  # compute stream time spent waiting for copies (host clock)
        self._host: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        for block in self.blocks:
            pairs = []
            for tensor in [*block.parameters(), *block.buffers()]:
                host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=cuda)
                host.copy_(tensor)
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=device)
                pairs.append((tensor, host))
            self._host.append(pairs)
        self._ready: dict[int, torch.cuda.Event | None] = {}
        self._hooks: list[RemovableHandle] = []
        for index, block in enumerate(self.blocks):
            self._hooks.append(block.register_forward_pre_hook(self._before(index)))
            self._hooks.append(block.register_forward_hook(self._after(index)))

    @property
    def block_bytes(self) -> int:
        return max((sum(h.numel() * h.element_size() for _, h in pairs) for pairs in self._host), default=0)

    def _fetch(self, index: int) -> None:
        """Start copying block `index` to the device (on the side stream when there is one)."""
        if index in self._ready:
            return
        compute = torch.cuda.current_stream(self.device) if self.stream is not None else None
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            for tensor, host in self._host[index]:
                copy = host.to(self.device, non_blocking=True)
                if compute is not None:
                    # Allocated on the side stream, used on the compute stream: keep the
                    # allocator from reusing it until the compute stream is done with it.
                    copy.record_stream(compute)
                tensor.data = copy
                self.bytes_moved += host.numel() * host.element_size()
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
                started = time.perf_counter()
                torch.cuda.current_stream(self.device).wait_event(event)
                self.seconds_waiting += time.perf_counter() - started
            self._fetch((index + 1) % len(self.blocks))  # overlaps this block's compute

        return hook

    def _after(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            for tensor, _ in self._host[index]:
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=self.device)
            self._ready.pop(index, None)

        return hook

    def close(self) -> None:
        """Remove the hooks and put every block back on the device for good."""
        for handle in self._hooks:
            handle.remove()
        for pairs in self._host:
            for tensor, host in pairs:
                tensor.data = host.to(self.device)
        self._hooks = []
        self._host = []
        self._ready = {}
