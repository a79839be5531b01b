"""One DiT forward spread over the ranks of a replica: Ulysses sequence parallel and CFG parallel,
through torch.distributed (gloo on the CPU, NCCL on GPUs), driven by a family's
SequenceParallelPlan (omni_common.models.base).

Sequence parallel (Ulysses). Each rank of a group holds a contiguous share of the image tokens
(`torch.tensor_split`: shares differ by at most one token, so any image size works) and every
text token (replicated: a prompt of any length needs no padding, and its mask stays as it is).
Around the attention call each rank trades heads for tokens: one all-to-all sends every rank the
image query/key/value of its heads for all tokens, attention runs on the joint sequence with
those heads, and one all-to-all returns each rank its own tokens with all heads, together with
the text tokens' output of every head (the text stream stays replicated). Heads split unevenly
too (3 heads on 2 ranks: 2 and 1). The DiT's output is gathered on the token dimension, so every
rank ends a forward with the whole prediction and steps identical latents.

CFG parallel. With true CFG and an even number of ranks, the ranks split in two halves: the
first runs the conditional branch, the second the unconditional one, each half sequence parallel
within itself, then each rank swaps its branch with its peer in the other half.

Not bitwise the one-device forward: attention sums its keys in another order. Hooks (not a fork
of the model): a forward pre-hook splits the image tokens, a hook on the rotary module splits its
per-token embeddings, a hook on the DiT gathers its output, and the attention function the plan
names is replaced in its module by a wrapper (in the device worker processes only, which run
nothing else); every hook passes through untouched while no group is in use (`use`). A family
may also install attention of its own (the plan's `overlapped`, Qwen-Image's ulysses.py) that
starts the all-to-all before it has projected every head, so the tensors move while it
projects the rest; the wrapper then serves only the layers that one declines (FP8).

Why not diffusers' own context parallel (0.42, `enable_parallelism` with the model's `_cp_plan`):
it cannot start without an accelerator (it takes the rank modulo the accelerator count: gloo on
the CPU fails), it fixes one mesh per model while CFG parallel picks the group per forward, and
it splits the text tokens too, so a prompt's length must divide by the ranks.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from omni_common.execution.spread import exchange, overlap_collectives, shares
from omni_common.models.module_layout import SequenceParallelPlan

Branch = Callable[[], torch.Tensor]


class Group:
    """A set of ranks one forward is spread over (its torch.distributed group)."""

    def __init__(self, ranks: list[int], handle: Any) -> None:
        self.ranks = ranks
        self.handle = handle  # a ProcessGroup; None for a group of one rank
        self.size = len(ranks)
        self.rank = ranks.index(dist.get_rank()) if dist.get_rank() in ranks else -1


def new_groups(world: int) -> tuple[Group, list[Group], list[Group]]:
    """The replica's groups: all ranks; the two CFG halves (for an even world); the peer pairs
    across the halves. Every rank creates every group, in the same order (torch.distributed's
    rule)."""

    def group(ranks: list[int]) -> Group:
        handle = dist.new_group(ranks) if len(ranks) > 1 else None
        return Group(ranks, handle)

    full = group(list(range(world)))
    if world < 2 or world % 2:
        return full, [], []
    half = world // 2
    halves = [group(list(range(h * half, (h + 1) * half))) for h in range(2)]
    pairs = [group([i, i + half]) for i in range(half)]
    return full, halves, pairs


def gather(x: torch.Tensor, dim: int, sizes: list[int], group: Group) -> torch.Tensor:
    """Each rank's piece of a tensor along `dim` (sizes by rank, uneven allowed), gathered."""
    if group.size == 1:
        return x
    longest = max(sizes)
    pad = [0, 0] * (x.dim() - dim - 1) + [0, longest - x.shape[dim]]
    padded = torch.nn.functional.pad(x, pad).contiguous()
    pieces = [torch.empty_like(padded) for _ in range(group.size)]
    dist.all_gather(pieces, padded, group=group.handle)
    return torch.cat([piece.narrow(dim, 0, size) for piece, size in zip(pieces, sizes, strict=True)], dim)


class SequenceParallel:
    """The plan's hooks on one rank's stage model, and the groups a forward may use."""

    def __init__(self, model: object, plan: SequenceParallelPlan, world: int) -> None:
        self.plan = plan
        self.dit: torch.nn.Module = _resolve(model, plan.module)
        config = self.dit.config
        self.heads = int(config[plan.heads])
        if self.heads < world:
            raise SystemExit(f"the DiT has {self.heads} attention heads, fewer than the {world} devices")
        if getattr(self.dit, "zero_cond_t", False):
            raise SystemExit("sequence parallel does not split this DiT's per-token modulation (zero_cond_t)")
        self.full, self.halves, self.pairs = new_groups(world)
        self.group: Group | None = None  # set by `use` for one forward
        # The image tokens' shares of the forward under way (set per forward, fixed by the
        # image size). The prompt's length is read from the attention's inputs, never stored:
        # compiled blocks would guard on a stored value and compile again for each length.
        self._token_shares: list[int] = []
        self.dit.register_forward_pre_hook(self._split_tokens, with_kwargs=True)
        self.dit.register_forward_hook(self._gather_output)
        _resolve(self.dit, plan.rotary).register_forward_hook(self._split_rotary)
        module_name, function = plan.attention.split(":")
        module = importlib.import_module(module_name)
        attention = getattr(module, function)
        if getattr(attention, "_omnistage_ulysses", False):
            raise RuntimeError(f"{plan.attention} is wrapped already (one SequenceParallel per process)")
        wrapped = self._wrap(attention)
        wrapped._omnistage_ulysses = True  # type: ignore[attr-defined]
        setattr(module, function, wrapped)
        if plan.overlapped and _function(plan.overlapped)(self.dit, self):
            overlap_collectives()

    @property
    def token_shares(self) -> list[int]:
        """Each rank's share of the image tokens of the forward under way."""
        return self._token_shares

    @property
    def cfg_parallel(self) -> bool:
        """Whether the two CFG branches run on different halves of the ranks."""
        return bool(self.halves)

    @contextlib.contextmanager
    def use(self, group: Group) -> Iterator[None]:
        """Forwards inside run sequence parallel over `group` (a group of one runs plainly)."""
        outer = self.group
        self.group = group if group.size > 1 else None
        try:
            yield
        finally:
            self.group = outer

    def group_key(self) -> tuple[int, ...]:
        """The ranks the forward under way spreads over (empty: it runs on this rank alone)."""
        return () if self.group is None else tuple(self.group.ranks)

    def branches(self, cond: Branch, uncond: Branch) -> tuple[torch.Tensor, torch.Tensor]:
        """The conditional and unconditional predictions: with CFG parallel each half of the
        ranks runs one branch, then peers swap; otherwise both run here, in order."""
        if not self.halves:
            return cond(), uncond()
        rank = dist.get_rank()
        half = self.full.size // 2
        mine = rank // half
        with self.use(self.halves[mine]):
            out = (cond if mine == 0 else uncond)().contiguous()
        pair = self.pairs[rank % half]
        both = [torch.empty_like(out) for _ in range(2)]
        dist.all_gather(both, out, group=pair.handle)
        return both[0], both[1]

    # The hooks: each passes through while no group is in use.

    def _split_tokens(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        group = self.group
        if group is None:
            return None
        tokens, text = kwargs.get(self.plan.tokens), kwargs.get(self.plan.text)
        if tokens is None or text is None:
            raise ValueError(
                f"sequence parallel needs {self.plan.tokens!r} and {self.plan.text!r} as keyword arguments"
            )
        self._token_shares = shares(tokens.shape[1], group.size)
        if min(self._token_shares) == 0:
            raise ValueError(f"{tokens.shape[1]} image tokens do not split over {group.size} devices")
        kwargs = {**kwargs, self.plan.tokens: tokens.tensor_split(group.size, dim=1)[group.rank]}
        return args, kwargs

    def _split_rotary(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        group = self.group
        if group is None:
            return None
        out, index = list(output), self.plan.rotary_output
        out[index] = out[index].tensor_split(group.size, dim=0)[group.rank]
        return type(output)(out)

    def _gather_output(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        group = self.group
        if group is None:
            return None
        if not isinstance(output, tuple):
            raise ValueError("sequence parallel needs the DiT called with return_dict=False")
        return (gather(output[0], 1, self._token_shares, group), *output[1:])

    def _wrap(self, attention: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def ulysses(
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attn_mask: torch.Tensor | None = None,
            *args: Any,
            **kwargs: Any,
        ) -> torch.Tensor:
            group = self.group
            if group is None:
                return attention(query, key, value, attn_mask, *args, **kwargs)
            return self._attend(attention, group, query, key, value, attn_mask, args, kwargs)

        return ulysses

    def _attend(
        self,
        attention: Callable[..., torch.Tensor],
        group: Group,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        """Joint attention over [text (replicated), this rank's image tokens], all heads in,
        all heads out; in between, every rank attends with its share of the heads over all
        tokens."""
        tokens, me = self._token_shares, group.rank
        batch, joint_length, heads, dim = query.shape
        length = joint_length - tokens[me]  # the prompt's tokens (symbolic under dynamic shapes)
        head_shares = shares(heads, group.size)
        lo = sum(head_shares[:me])
        mine = slice(lo, lo + head_shares[me])
        qkv = torch.stack([query, key, value])  # [3, B, L + n, H, D]
        text, image = qkv[:, :, :length], qkv[:, :, length:]
        # Image q/k/v: my tokens of rank r's heads go to rank r; all tokens of my heads come back.
        bounds = [sum(head_shares[:r]) for r in range(group.size + 1)]
        sent = [image[:, :, :, bounds[r] : bounds[r + 1]] for r in range(group.size)]
        got = exchange(sent, [(3, batch, n, head_shares[me], dim) for n in tokens], group)
        joint = torch.cat([text[:, :, :, mine], *got], dim=2)
        mask = attn_mask
        if mask is not None:  # [B, 1, 1, L + n] over keys: gather the image keys' part
            image_keys = gather(mask[..., length:], mask.dim() - 1, tokens, group)
            mask = torch.cat([mask[..., :length], image_keys], -1)
        out = attention(joint[0], joint[1], joint[2], mask, *args, **kwargs)  # [B, L + N, h, D]
        # Back: rank r gets its tokens with my heads, and the text with my heads.
        image_out = out[:, length:].tensor_split(group.size, dim=1)
        back = [torch.cat([image_out[r].reshape(-1), out[:, :length].reshape(-1)]) for r in range(group.size)]
        n = tokens[me]
        returned = exchange(back, [((n + length) * batch * h * dim,) for h in head_shares], group)
        image_parts, text_parts = [], []
        for part, h in zip(returned, head_shares, strict=True):
            image_parts.append(part[: batch * n * h * dim].reshape(batch, n, h, dim))
            text_parts.append(part[batch * n * h * dim :].reshape(batch, length, h, dim))
        return torch.cat([torch.cat(text_parts, dim=2), torch.cat(image_parts, dim=2)], dim=1)


def _resolve(root: object, path: str) -> Any:
    for name in path.split(".") if path else []:
        root = getattr(root, name)
    return root


def _function(name: str) -> Any:
    """A plan's "module:function", imported."""
    module, function = name.split(":")
    return getattr(importlib.import_module(module), function)
