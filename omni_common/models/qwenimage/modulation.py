"""Qwen-Image's timestep modulation computed once per schedule instead of once per step.

Each block's `img_mod` and `txt_mod` (SiLU, then a linear layer 3072 -> 18432) depend on the
timestep only. A step reads their 6.8 B parameters to multiply one vector per row: 4-6 ms a
step on an H200 whatever the image size, 13% of a 512x512 step (benchmarks/dit_profile.py).
A request's timesteps are fixed when it starts, and requests of one size and step count
share them, so `ModulationCache` computes the modulation of every timestep of a schedule in
one batched product and keeps it. The forward then takes, in place of the timestep, the
packed rows [rows, PACKED]: every block's img_mod and txt_mod output, then the timestep
embedding itself (the output norm's input).

`pack_modulation` swaps the classes of the modules that read the timestep for subclasses
that take either input: a timestep computes as diffusers does (the eager path, LoRA adapters
on the modulation layers), packed rows are sliced. Module names, weights and hooks stay.
Each modulation layer finds its row through a buffer, not a Python number, so the compiled
blocks remain one graph for all 60 blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

import torch
from diffusers.models.normalization import AdaLayerNormContinuous
from diffusers.models.transformers.transformer_qwenimage import (
    QwenImageTransformer2DModel,
    QwenTimestepProjEmbeddings,
)

MAX_CACHE_BYTES = 1 << 30  # ~11 schedules of 20 steps at Qwen-Image's size


class _PackedTimestepEmbedding(QwenTimestepProjEmbeddings):
    """The transformer's time_text_embed: packed rows pass through."""

    def forward(
        self, timestep: torch.Tensor, hidden_states: torch.Tensor, addition_t_cond: torch.Tensor | None = None
    ) -> torch.Tensor:
        if timestep.dim() == 2:
            return timestep
        return super().forward(timestep, hidden_states, addition_t_cond)


class _PackedModulation(torch.nn.Sequential):
    """A block's img_mod or txt_mod (SiLU, Linear): a timestep embedding is multiplied,
    packed rows give this layer's row (the buffer `packed_row`)."""

    packed_row: torch.Tensor

    def forward(self, temb: torch.Tensor) -> torch.Tensor:
        linear = _linear(self)
        if temb.shape[-1] == linear.in_features:
            return super().forward(temb)
        width = linear.out_features
        layers = (temb.shape[-1] - linear.in_features) // width
        rows = temb[:, : layers * width].view(temb.shape[0], layers, width)
        return rows.index_select(1, self.packed_row).squeeze(1)


class _PackedNormOut(AdaLayerNormContinuous):
    """The output norm: from packed rows it takes their tail, the timestep embedding."""

    def forward(self, x: torch.Tensor, conditioning_embedding: torch.Tensor) -> torch.Tensor:
        dim = self.linear.in_features
        if conditioning_embedding.shape[-1] != dim:
            conditioning_embedding = conditioning_embedding[:, -dim:]
        return super().forward(x, conditioning_embedding)


def _linear(layer: torch.nn.Module) -> torch.nn.Linear:
    """The linear layer of a modulation layer (SiLU, Linear)."""
    linear = layer[1]  # type: ignore[index]
    assert isinstance(linear, torch.nn.Linear)
    return linear


def swap_class(module: torch.nn.Module, base: type, packed: type) -> None:
    """Give `module` the subclass `packed` of its class `base` (idempotent): its weights, name
    and hooks stay."""
    if not isinstance(module, packed):
        if type(module) is not base:
            found = type(module).__name__
            raise ValueError(f"expected a {base.__name__} to make a {packed.__name__}, found {found}")
        module.__class__ = packed


def modulation_layers(transformer: QwenImageTransformer2DModel) -> list[torch.nn.Module]:
    """Every block's img_mod and txt_mod, in the order of the packed rows."""
    blocks: torch.nn.ModuleList = transformer.transformer_blocks
    return [layer for block in blocks for layer in (block.img_mod, block.txt_mod)]  # type: ignore[misc]


def pack_modulation(transformer: QwenImageTransformer2DModel) -> None:
    """Let `transformer` take packed modulation rows (ModulationCache.table) as its timestep."""
    if transformer.config.get("zero_cond_t") or transformer.config.get("guidance_embeds"):
        raise ValueError("packed modulation covers Qwen-Image without zero_cond_t or guidance")
    swap_class(transformer.time_text_embed, QwenTimestepProjEmbeddings, _PackedTimestepEmbedding)
    swap_class(transformer.norm_out, AdaLayerNormContinuous, _PackedNormOut)
    device = next(transformer.parameters()).device
    for row, layer in enumerate(modulation_layers(transformer)):
        swap_class(layer, torch.nn.Sequential, _PackedModulation)
        layer.register_buffer("packed_row", torch.tensor([row], device=device), persistent=False)


def packed_width(transformer: QwenImageTransformer2DModel) -> int:
    """Columns of one packed row: every modulation layer's output, then the embedding."""
    layers = modulation_layers(transformer)
    return sum(_linear(layer).out_features for layer in layers) + _linear(layers[0]).in_features


class ModulationCache:
    """Packed modulation rows per schedule (a hashable naming its timesteps), least recently
    used dropped beyond `max_bytes`. `clear` after the weights change in place."""

    def __init__(self, transformer: QwenImageTransformer2DModel, max_bytes: int = MAX_CACHE_BYTES) -> None:
        pack_modulation(transformer)
        self.transformer = transformer
        self.max_bytes = max_bytes
        self.width = packed_width(transformer)
        self._tables: OrderedDict[Hashable, torch.Tensor] = OrderedDict()

    @torch.inference_mode()
    def table(self, schedule: Hashable, timesteps: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[steps, PACKED] for `timesteps` (the scheduler's, 0..1000) of `schedule`."""
        table = self._tables.get(schedule)
        if table is None:
            table = self._pack(timesteps, dtype)
            self._tables[schedule] = table
            while sum(t.nbytes for t in self._tables.values()) > self.max_bytes and len(self._tables) > 1:
                self._tables.popitem(last=False)
        self._tables.move_to_end(schedule)
        return table

    def _pack(self, timesteps: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        transformer = self.transformer
        # As the forward takes it: rounded to the model dtype, scaled, rounded again.
        timestep = (timesteps.to(dtype) / 1000).to(dtype)
        like = torch.empty(0, dtype=dtype, device=timestep.device)  # the embedding's dtype
        temb = transformer.time_text_embed(timestep, like, None)
        rows = [layer(temb) for layer in modulation_layers(transformer)]
        return torch.cat([*rows, temb], dim=1)

    def clear(self) -> None:
        self._tables.clear()
