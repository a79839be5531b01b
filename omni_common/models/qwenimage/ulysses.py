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

from omni_common.execution.spread import Spread, SpreadGroup, finish, shares, start_all_to_all

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
        spreads = (
            encoder_hidden_states is not None and attention_mask is None and image_rotary_emb is not None
        )
        if group is None or not spreads:
            plain: Any = super().__call__  # diffusers types its tensors as FloatTensor
            return plain(
                attn,
                hidden_states,
                encoder_hidden_states,
                encoder_hidden_states_mask,
                attention_mask,
                image_rotary_emb,
            )
        assert encoder_hidden_states is not None and image_rotary_emb is not None
        split = _Split(attn, group.rank, group.size, self.spread.token_shares)
        image_freqs, text_freqs = image_rotary_emb
        # 1. Other ranks' heads first, and off they go.
        me, per_token = split.me, hidden_states.shape[0] * 3 * split.dim
        sent = [0 if r == me else per_token * split.tokens[me] * h for r, h in enumerate(split.heads)]
        received = [0 if r == me else per_token * n * split.mine for r, n in enumerate(split.tokens)]
        heads = [_image_heads(attn, hidden_states, image_freqs, split, r).reshape(-1) for r in split.others]
        pending = start_all_to_all(_joined(heads), sent, received, group)
        # 2. This rank's heads, image and text, while they move.
        local = _image_heads(attn, hidden_states, image_freqs, split, split.me)
        text_q, text_k, text_v = _text_heads(attn, encoder_hidden_states, text_freqs, split)
        # 3. Every rank's image tokens with this rank's heads, after the text.
        batch = hidden_states.shape[0]
        shapes = [(batch, n, split.mine, 3, split.dim) for n in split.tokens]
        parts = finish(pending, received, [(0,) if r == me else shape for r, shape in enumerate(shapes)])
        image = torch.cat([local if r == me else part for r, part in enumerate(parts)], dim=1)
        query, key, value = (
            torch.cat([t, image[..., i, :]], dim=1) for i, t in enumerate((text_q, text_k, text_v))
        )
        mask = encoder_hidden_states_mask
        if mask is not None:
            image_keys = torch.ones((batch, sum(split.tokens)), dtype=torch.bool, device=mask.device)
            mask = torch.cat([mask, image_keys], dim=1)[:, None, None, :]
        # diffusers' own function: the generic path wraps the name in transformer_qwenimage.
        out = dispatch_attention_fn(
            query, key, value, attn_mask=mask, dropout_p=0.0, is_causal=False, backend=self._attention_backend
        ).to(query.dtype)  # [B, L + N, h, D]
        return _back(attn, out, encoder_hidden_states.shape[1], split, group)


class _Split:
    """How one spread forward divides a block's attention: this rank (`me`) of `size`, each
    rank's heads and image tokens, the head size."""

    def __init__(self, attn: Any, me: int, size: int, tokens: list[int]) -> None:
        self.me, self.size, self.tokens = me, size, tokens
        self.heads = shares(attn.heads, size)
        self.dim = attn.inner_dim // attn.heads
        self.mine = self.heads[me]
        self.first = [sum(self.heads[:r]) for r in range(size + 1)]  # rank r's heads: first[r]:first[r + 1]
        self.others = [r for r in range(size) if r != me]

    def columns(self, r: int) -> slice:
        """Rank r's heads in a [heads x dim] axis."""
        return slice(self.first[r] * self.dim, self.first[r + 1] * self.dim)


def _image_heads(
    attn: Any, hidden_states: torch.Tensor, freqs: torch.Tensor, split: _Split, r: int
) -> torch.Tensor:
    """This rank's image tokens with rank r's heads: [B, n, h_r, 3 (q k v), D], q and k normed
    and rotated."""
    rows = slice(3 * split.dim * split.first[r], 3 * split.dim * split.first[r + 1])
    joint = F.linear(hidden_states, getattr(attn, JOINT)[rows], getattr(attn, f"{JOINT}_bias")[rows])
    q, k, v = joint.unflatten(-1, (split.heads[r], 3, split.dim)).unbind(-2)
    return torch.stack([_rotate(attn.norm_q(q), freqs), _rotate(attn.norm_k(k), freqs), v], dim=-2)


def _text_heads(
    attn: Any, encoder_hidden_states: torch.Tensor, freqs: torch.Tensor, split: _Split
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The text's q, k, v with this rank's heads [B, L, h, D]: its rows of the text layers."""
    rows = split.columns(split.me)
    q, k, v = (
        F.linear(
            encoder_hidden_states, layer.weight[rows], None if layer.bias is None else layer.bias[rows]
        ).unflatten(-1, (split.mine, split.dim))
        for layer in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
    )
    return _rotate(attn.norm_added_q(q), freqs), _rotate(attn.norm_added_k(k), freqs), v


def _back(
    attn: Any, out: torch.Tensor, length: int, split: _Split, group: SpreadGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """4. Rank r gets its tokens and the text, with this rank's heads. While they move, this
    rank's heads of its own tokens go through their columns of the output projection; the
    others' add theirs as they arrive. Returns (image, text) outputs, as diffusers' processor."""
    me, tokens, batch = split.me, split.tokens, out.shape[0]
    text_out, image_out = out[:, :length], out[:, length:].tensor_split(split.size, dim=1)
    count = batch * split.dim
    sent = [0 if r == me else count * (n + length) * split.mine for r, n in enumerate(tokens)]
    received = [0 if r == me else count * (tokens[me] + length) * h for r, h in enumerate(split.heads)]
    pieces = [torch.cat([image_out[r].reshape(-1), text_out.reshape(-1)]) for r in split.others]
    pending = start_all_to_all(_joined(pieces), sent, received, group)
    output = attn.to_out[0]
    image = F.linear(image_out[me].flatten(2), output.weight[:, split.columns(me)], output.bias)
    parts = finish(pending, received, [(n,) for n in received])
    text = [text_out.flatten(2) if r == me else None for r in range(split.size)]
    for r in split.others:
        cut = count * tokens[me] * split.heads[r]
        image = image + F.linear(
            parts[r][:cut].reshape(batch, tokens[me], split.heads[r] * split.dim),
            output.weight[:, split.columns(r)],
        )
        text[r] = parts[r][cut:].reshape(batch, length, split.heads[r] * split.dim)
    if len(attn.to_out) > 1:
        image = attn.to_out[1](image)  # dropout
    return image, attn.to_add_out(torch.cat([t for t in text if t is not None], dim=-1))


def _joined(pieces: list[torch.Tensor]) -> torch.Tensor:
    """Flat pieces as one buffer (a lone piece as it is: no copy)."""
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    # Looked up per call: use_real_rotary replaces the module's function for compiled forwards.
    rotated: torch.Tensor = transformer_qwenimage.apply_rotary_emb_qwen(x, freqs, use_real=False)  # type: ignore[assignment]
    return rotated
