"""GLM-Image edit mode: condition images -> the keys and values the DiT attends to.

Reads like step 6 of `GlmImagePipeline.__call__` in diffusers 0.42.1: each condition image's
normalized latents go through the transformer once, at timestep 0, with no text and with its
own prior tokens, while every attention layer stores its image keys and values (after QK norm
and RoPE). Every denoising forward of the conditional branch then prepends them to its own
keys and values; the unconditional branch does not see them.

The stored tensors travel as "condition_kv.k" / "condition_kv.v", each [layers, 1, S, heads,
head_dim] with S the condition tokens of all images in order, which is what the pipeline's
GlmImageLayerKVCache holds for one sample.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from diffusers.models.transformers.transformer_glm_image import (
    GlmImageKVCache,
    GlmImageTransformer2DModel,
)

from omni_common.errors import InvalidArgument
from omni_common.models.base import RoleCall, StageState
from omni_common.models.glm_image.vae import condition_latents_name

CONDITION_K = "condition_kv.k"
CONDITION_V = "condition_kv.v"


class GlmImageConditionKv:
    """Role "condition-kv" (BatchRunner): "condition_latents.{i}", "prior_token_image_ids" [M]
    and "source_image_grid_thw" [images, 3] -> "condition_kv.k"/"condition_kv.v", meta
    "condition_tokens" = S. Each request runs alone (the pipeline's own forwards)."""

    def __init__(
        self,
        transformer: GlmImageTransformer2DModel,
        device: torch.device,
        dtype: torch.dtype,
        vae_scale_factor: int,
    ) -> None:
        self.transformer = transformer
        self.device = device
        self.dtype = dtype
        self.vae_scale_factor = vae_scale_factor

    def cost(self, call: RoleCall) -> int:
        """Condition tokens: (h/2)(w/2) per condition image of h x w latents."""
        patch = self.transformer.config["patch_size"]
        return sum(
            (latent.shape[-2] // patch) * (latent.shape[-1] // patch)
            for latent in condition_latents(call.inputs).values()
        )

    def run_batch(self, calls: Sequence[RoleCall]) -> list[StageState]:
        return [self.condition_kv(call) for call in calls]

    @torch.inference_mode()
    def condition_kv(self, call: RoleCall) -> StageState:
        """The write-mode forwards of one request's condition images."""
        # The stage sees the latents, not the images: their count is the images'.
        latents = [self._latents(call.inputs, i) for i in range(len(condition_latents(call.inputs)))]
        if not latents:
            raise InvalidArgument(
                f"condition-kv needs {condition_latents_name(0)!r} (and one per further image)"
            )
        prior_ids = self._prior_ids(call.inputs, latents)
        config = self.transformer.config
        cache = GlmImageKVCache(num_layers=config["num_layers"])
        cache.set_mode("write")  # each forward appends its keys/values along the sequence
        no_text = torch.zeros((1, 0, config["text_embed_dim"]), device=self.device, dtype=self.dtype)
        for latent, ids in zip(latents, prior_ids, strict=True):
            pixel_size = [latent.shape[2] * self.vae_scale_factor, latent.shape[3] * self.vae_scale_factor]
            self.transformer(
                hidden_states=latent,
                encoder_hidden_states=no_text,
                prior_token_id=ids,
                prior_token_drop=torch.zeros_like(ids, dtype=torch.bool),
                # float32 and int64 whatever the model dtype, as the pipeline passes them.
                timestep=torch.zeros((1,), device=self.device),
                target_size=torch.tensor([pixel_size], device=self.device),
                crop_coords=torch.zeros((1, 2), device=self.device),
                kv_caches=cache,
            )
        # One sample, so each layer holds one entry: all images' keys, joined along the sequence.
        keys = torch.stack([_stored(layer.k_caches) for layer in cache.caches])
        values = torch.stack([_stored(layer.v_caches) for layer in cache.caches])
        return StageState({CONDITION_K: keys, CONDITION_V: values}, {"condition_tokens": str(keys.shape[2])})

    def _latents(self, inputs: StageState, index: int) -> torch.Tensor:
        name = condition_latents_name(index)
        latent = inputs.tensors.get(name)
        if latent is None:
            raise InvalidArgument(f"condition-kv input lacks the tensor {name!r}")
        patch = self.transformer.config["patch_size"]
        channels = self.transformer.config["in_channels"]
        if (
            latent.dim() != 4
            or latent.shape[:2] != (1, channels)
            or latent.shape[2] % patch
            or latent.shape[3] % patch
            or latent.numel() == 0
        ):
            raise InvalidArgument(
                f"{name} has shape {tuple(latent.shape)}; expected [1, {channels}, h, w] with h and w "
                f"positive multiples of {patch}"
            )
        return latent.to(device=self.device, dtype=self.dtype)

    def _prior_ids(self, inputs: StageState, latents: list[torch.Tensor]) -> list[torch.Tensor]:
        """The prior token ids of each condition image (split by the grids), checked against
        the image tokens of its latents."""
        ids = inputs.tensors.get("prior_token_image_ids")
        grids = inputs.tensors.get("source_image_grid_thw")
        if ids is None or grids is None:
            raise InvalidArgument("condition-kv needs 'prior_token_image_ids' and 'source_image_grid_thw'")
        integers = not (ids.is_floating_point() or grids.is_floating_point())
        if ids.dim() != 1 or grids.shape != (len(latents), 3) or not integers:
            raise InvalidArgument(
                f"prior_token_image_ids must be 1-D integers and source_image_grid_thw [{len(latents)}, 3]; "
                f"got {tuple(ids.shape)} and {tuple(grids.shape)}"
            )
        vocabulary = self.transformer.config["prior_vq_quantizer_codebook_size"]
        check_token_ids(ids, vocabulary, "prior_token_image_ids")
        sizes = [int(size) for size in grids.prod(dim=-1).tolist()]
        patch = self.transformer.config["patch_size"]
        for index, (size, latent) in enumerate(zip(sizes, latents, strict=True)):
            tokens = (latent.shape[2] // patch) * (latent.shape[3] // patch)
            if size != tokens:
                raise InvalidArgument(
                    f"condition image {index}: the prior's grid {grids[index].tolist()} has {size} tokens, "
                    f"its latents {tokens}"
                )
        if sum(sizes) != ids.shape[0]:
            raise InvalidArgument(
                f"prior_token_image_ids has {ids.shape[0]} ids; the grids need {sum(sizes)}"
            )
        return list(torch.split(ids.to(device=self.device, dtype=torch.long), sizes))


def _stored(entries: list[torch.Tensor | None]) -> torch.Tensor:
    entry = entries[0]
    assert entry is not None  # written by the forwards above
    return entry


def check_token_ids(ids: torch.Tensor, vocabulary: int, name: str) -> None:
    """InvalidArgument unless every id indexes the DiT's prior embedding table."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocabulary):
        raise InvalidArgument(f"{name} holds ids outside [0, {vocabulary})")


def condition_latents(inputs: StageState) -> dict[str, torch.Tensor]:
    """The condition images' latents among `inputs`, numbered from 0 without gaps."""
    found: dict[str, torch.Tensor] = {}
    while (latent := inputs.tensors.get(condition_latents_name(len(found)))) is not None:
        found[condition_latents_name(len(found))] = latent
    return found


def checked_condition_kv(
    tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The condition keys/values among a denoise call's tensors (an edit request's; None for a
    text-to-image one: the denoise stage sees the KV, not the images), both or neither, shaped
    for the transformer of `config`."""
    keys, values = tensors.get(CONDITION_K), tensors.get(CONDITION_V)
    if keys is None and values is None:
        return None
    if keys is None or values is None:
        raise InvalidArgument(f"condition keys/values come as a pair: {CONDITION_K!r} and {CONDITION_V!r}")
    expected = (config["num_layers"], 1, config["num_attention_heads"], config["attention_head_dim"])
    if (
        keys.dim() != 5
        or keys.shape != values.shape
        or (keys.shape[0], keys.shape[1], keys.shape[3], keys.shape[4]) != expected
        or keys.shape[2] == 0
    ):
        layers, _, heads, head_dim = expected
        raise InvalidArgument(
            f"condition keys/values of shapes {tuple(keys.shape)}/{tuple(values.shape)}; expected "
            f"[{layers}, 1, S, {heads}, {head_dim}] each"
        )
    return keys, values


def read_cache(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> GlmImageKVCache:
    """A read-mode cache for a batch whose row i attends to condition keys/values [layers, 1,
    S, heads, head_dim] `keys[i]`/`values[i]` (all of one S): each layer lists one tensor per
    row, which GlmImageLayerKVCache.get concatenates along the batch (one row: used as is)."""
    cache = GlmImageKVCache(num_layers=keys[0].shape[0])
    for index, layer in enumerate(cache.caches):
        layer.k_caches = [k[index] for k in keys]
        layer.v_caches = [v[index] for v in values]
    cache.set_mode("read")
    return cache
