"""Qwen-Image's joint attention spread over the ranks of a group (Ulysses), its all-to-alls
overlapped with the projections on either side.

The runtime's generic path (omni_common/runtime/sequence_parallel.py) wraps the attention
function: by the time it runs, the block has projected every head of its image tokens, so the
all-to-all that trades heads for tokens has nothing left to overlap and the GPU waits for it
(7-10 ms of a 79 ms step at 1024x1024 on 2 GPUs, docs/benchmarks.md), and packing the
projections for it costs copies of its own. This processor, installed on the blocks' attention
modules in the device workers of such a replica, projects the image tokens by destination
instead:

1. the q/k/v of the heads other ranks attend with, as one product per rank over a joint weight
   whose rows run head by head (q, k and v of head 0, then of head 1, ...: any group size takes
   a contiguous block), RMS-normed and rotated, straight into the all-to-all, which starts;
2. while it moves, the q/k/v of this rank's own heads and the text's (the text is replicated:
   this rank projects only its heads' rows of the text weights);
3. the wait, then attention over [text, every rank's image tokens] with this rank's heads;
4. the all-to-all back (each rank's tokens and the text, with this rank's heads), and while it
   moves, this rank's heads of its own tokens through their columns of the output projection;
   the other ranks' heads add their columns' products when they arrive.

The joint weight is a copy (3 x 3072 x 3072 a block, 3.4 GB over Qwen-Image's 60 blocks): the
model's own q/k/v layers stay as they are for the forwards this rank runs alone, which keep
diffusers' processor and its products bit for bit. Where those layers are not plain linear ones
(--quantization fp8), nothing is installed and the generic path spreads the attention.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers import transformer_qwenimage
from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0
from torch.nn import functional as F

from omni_common.execution.spread import Spread, finish, shares, start_all_to_all

JOINT = "ulysses_qkv"  # the attention module's buffer of joint q/k/v rows, head by head


def install(transformer: torch.nn.Module, spread: Spread) -> bool:
    """Give every block's attention this processor (its joint weight built from the module's
    q/k/v layers); False, and nothing changed, where a block's layers are not plain linear ones."""
    modules = [block.attn for block in transformer.transformer_blocks]  # type: ignore[union-attr]
    if not all(_plain(attn) for attn in modules):
        return False
    for attn in modules:
        heads, dim = attn.heads, attn.inner_dim // attn.heads
        layers = (attn.to_q, attn.to_k, attn.to_v)
        rows = torch.stack([layer.weight.unflatten(0, (heads, dim)) for layer in layers], dim=1)
        attn.register_buffer(JOINT, rows.flatten(0, 2).contiguous(), persistent=False)
        biases = [layer.bias.unflatten(0, (heads, dim)) for layer in layers]
        attn.register_buffer(
            f"{JOINT}_bias", torch.stack(biases, dim=1).flatten().contiguous(), persistent=False
        )
        processor = SpreadAttention(spread)
        processor._attention_backend = attn.processor._attention_backend
        attn.processor = processor
    return True


def _plain(attn: Any) -> bool:
    layers = (attn.to_q, attn.to_k, attn.to_v)
    return (
        isinstance(attn.processor, QwenDoubleStreamAttnProcessor2_0)
        and all(type(layer) is torch.nn.Linear and layer.bias is not None for layer in layers)
        and type(attn.to_out[0]) is torch.nn.Linear
    )


class SpreadAttention(QwenDoubleStreamAttnProcessor2_0):
    """diffusers' processor while no group is in use; spread over the group otherwise."""

    def __init__(self, spread: Spread) -> None:
        super().__init__()
        self.spread = spread

    def __call__(  # type: ignore[override]
        self,
        attn: Any,  # diffusers' Attention
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        group = self.spread.group
        if (
            group is None
            or encoder_hidden_states is None
            or attention_mask is not None
            or image_rotary_emb is None
        ):
            plain: Any = super().__call__  # diffusers types its tensors as FloatTensor
            return plain(
                attn,
                hidden_states,
                encoder_hidden_states,
                encoder_hidden_states_mask,
                attention_mask,
                image_rotary_emb,
            )
        tokens, me, size = self.spread.token_shares, group.rank, group.size
        batch, length = hidden_states.shape[0], encoder_hidden_states.shape[1]
        heads, dim = shares(attn.heads, size), attn.inner_dim // attn.heads
        bounds = [sum(heads[:r]) for r in range(size + 1)]
        image_freqs, text_freqs = image_rotary_emb

        def image_heads(r: int) -> torch.Tensor:
            """This rank's image tokens with rank r's heads: [B, n, h_r, 3 (q k v), D]."""
            rows = slice(3 * dim * bounds[r], 3 * dim * bounds[r + 1])
            joint = F.linear(hidden_states, getattr(attn, JOINT)[rows], getattr(attn, f"{JOINT}_bias")[rows])
            q, k, v = joint.unflatten(-1, (heads[r], 3, dim)).unbind(-2)
            q = _rotate(attn.norm_q(q), image_freqs)
            k = _rotate(attn.norm_k(k), image_freqs)
            return torch.stack([q, k, v], dim=-2)

        # 1. Other ranks' heads first, and off they go.
        sent = [0 if r == me else batch * tokens[me] * heads[r] * 3 * dim for r in range(size)]
        received = [0 if r == me else batch * tokens[r] * heads[me] * 3 * dim for r in range(size)]
        pending = start_all_to_all(
            _joined([image_heads(r).reshape(-1) for r in range(size) if r != me]), sent, received, group
        )
        # 2. This rank's heads, image and text, while they move.
        local = image_heads(me)
        text = [
            F.linear(
                encoder_hidden_states,
                layer.weight[bounds[me] * dim : bounds[me + 1] * dim],
                _rows(layer, bounds, me, dim),
            ).unflatten(-1, (heads[me], dim))
            for layer in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
        ]
        text_q = _rotate(attn.norm_added_q(text[0]), text_freqs)
        text_k = _rotate(attn.norm_added_k(text[1]), text_freqs)
        # 3. Every rank's image tokens with this rank's heads, after the text.
        shapes = [(0,) if r == me else (batch, tokens[r], heads[me], 3, dim) for r in range(size)]
        parts = finish(pending, received, shapes)
        image = torch.cat([local if r == me else parts[r] for r in range(size)], dim=1)
        query, key, value = (
            torch.cat([t, image[..., i, :]], dim=1) for i, t in enumerate((text_q, text_k, text[2]))
        )
        mask = encoder_hidden_states_mask
        if mask is not None:
            image_keys = torch.ones((batch, sum(tokens)), dtype=torch.bool, device=mask.device)
            mask = torch.cat([mask, image_keys], dim=1)[:, None, None, :]
        # diffusers' own function: the generic path wraps the name in transformer_qwenimage.
        out = dispatch_attention_fn(
            query, key, value, attn_mask=mask, dropout_p=0.0, is_causal=False, backend=self._attention_backend
        ).to(query.dtype)  # [B, L + N, h, D]
        # 4. Back: rank r gets its tokens and the text, with this rank's heads. While they move,
        # this rank's heads of its own tokens go through their columns of the output projection.
        text_out, image_out = out[:, :length], out[:, length:].tensor_split(size, dim=1)
        sent = [0 if r == me else batch * (tokens[r] + length) * heads[me] * dim for r in range(size)]
        received = [0 if r == me else batch * (tokens[me] + length) * heads[r] * dim for r in range(size)]
        pieces = [torch.cat([image_out[r].reshape(-1), text_out.reshape(-1)]) for r in range(size) if r != me]
        pending = start_all_to_all(_joined(pieces), sent, received, group)
        output = attn.to_out[0]
        columns = [output.weight[:, bounds[r] * dim : bounds[r + 1] * dim] for r in range(size)]
        image_attn = F.linear(image_out[me].flatten(2), columns[me], output.bias)
        parts = finish(pending, received, [(count,) for count in received])
        text_parts = []
        for r in range(size):
            if r == me:
                text_parts.append(text_out.flatten(2))
                continue
            cut = batch * tokens[me] * heads[r] * dim
            image_attn = image_attn + F.linear(parts[r][:cut].reshape(batch, tokens[me], -1), columns[r])
            text_parts.append(parts[r][cut:].reshape(batch, length, heads[r] * dim))
        if len(attn.to_out) > 1:
            image_attn = attn.to_out[1](image_attn)  # dropout
        return image_attn, attn.to_add_out(torch.cat(text_parts, dim=-1))


def _joined(pieces: list[torch.Tensor]) -> torch.Tensor:
    """Flat pieces as one buffer (a lone piece as it is: no copy)."""
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _rows(layer: torch.nn.Linear, bounds: list[int], rank: int, dim: int) -> torch.Tensor | None:
    return None if layer.bias is None else layer.bias[bounds[rank] * dim : bounds[rank + 1] * dim]


def _rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    # Looked up per call: use_real_rotary replaces the module's function for compiled forwards.
    rotated: torch.Tensor = transformer_qwenimage.apply_rotary_emb_qwen(x, freqs, use_real=False)  # type: ignore[assignment]
    return rotated
