"""LoRA adapters applied at run time, per batch row, to a model's linear layers.

A family's step runner owns one `LoraLayers` over the module that takes adapters (Qwen-Image:
the DiT) and hands it a reader that turns an adapter file into diffusers' key format
(`<module path>.lora_A.weight` [rank, in], `<module path>.lora_B.weight` [out, rank]). The
base weights are never changed: a forward hook on each adapted nn.Linear adds, for every batch
row, `lora_B(lora_A(x)) * scaling` per adapter of that row, in the order the request named
them. That is PEFT's unfused LoRA forward, term for term (`result + lora_B(lora_A(x)) *
scaling`, scaling = scale * lora_alpha / rank), so one request equals diffusers'
`load_lora_weights` + `set_adapters` bit for bit on the CPU in fp32, and `fuse_lora` up to the
rounding of the fused weight. Rows of one forward may carry different adapters (or none), so
requests with different adapters share one step: per adapter position (each row's first, second,
... adapter) one batched LoRA forward, the rows' factors stacked, two bmm and per-row scalings,
added to those rows only (benchmarks/lora.py: faster than a forward per adapter set).

What a runner promises around a forward: `rows(...)` names each batch row's adapters (the
hooks do nothing outside it), and `acquire` / `release` bracket a request's use of its
adapters, which can then be neither removed nor evicted. Every method runs on the stage's one
compute thread (between steps), except `names`, a snapshot any thread may read.

Adapters are bounded in bytes: adding (or loading on demand from the replica's adapter
directory) evicts the least recently used adapters that are neither pinned nor in use; an
adapter that cannot fit is RESOURCE_EXHAUSTED. A file with unknown modules, wrong shapes, NaN
or Inf, or parts this implementation does not apply (DoRA, lora_B biases, per-module alpha
patterns) is INVALID_ARGUMENT, and nothing already loaded changes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from omni_common.checked_files import SafetensorsHeader
from omni_common.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from omni_common.models.lora_files import (
    LoraAdapter,
    Reader,
    adapter_file,
    check_name,
    check_scale,
    checked_layers,
    lora_alpha,
)
from omni_common.models.weights import local_path, read_safetensors


@dataclass(frozen=True)
class LoraInfo:
    """What ListLoras says of one adapter."""

    name: str
    source: str
    scale: float
    rank: int
    modules: int
    nbytes: int
    pinned: bool
    users: int


# One row's adapters: (adapter, the request's scale) in the order the request named them.
RowAdapters = tuple[tuple[LoraAdapter, float], ...]
# A slot's batched factors for one module: row index, lora_A [n, r, in], lora_B [n, out, r],
# scaling [n, 1, 1].
Stacked = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class LoraLayers:
    """The adapters of one model (module `root`) and the hooks that apply them."""

    def __init__(
        self,
        root: torch.nn.Module,
        reader: Reader,
        *,
        device: torch.device,
        dtype: torch.dtype,
        max_bytes: int = 1 << 30,
        directory: Path | None = None,
    ) -> None:
        self.root = root
        self.reader = reader
        self.device = device
        self.dtype = dtype
        self.max_bytes = max_bytes
        self.directory = directory  # where requests may name adapters not loaded yet
        self.targets = {name: m for name, m in root.named_modules() if isinstance(m, torch.nn.Linear)}
        self.adapters: dict[str, LoraAdapter] = {}
        self.names: tuple[str, ...] = ()  # snapshot for other threads (StageInfo)
        self._rows: list[RowAdapters] | None = None
        # Rows of one forward by adapter position (AdapterPosition), None when all rows match.
        self._slots: list[AdapterPosition] | None = None
        # Per adapted module: the stacked factors of the last slot composition seen (a batch's
        # composition repeats step after step).
        self._stacks: dict[str, tuple[tuple[object, ...], Stacked]] = {}
        self._uses: dict[str, int] = {}  # adapted module path -> adapters using it
        self._hooks: dict[str, torch.utils.hooks.RemovableHandle] = {}

    # -- control (AddLora / RemoveLora / ListLoras / PinLora) --------------------------------

    def add(self, name: str, path: Path, scale: float = 1.0, pinned: bool = False) -> LoraInfo:
        """Load an adapter file under `name` (replacing an unused adapter of that name)."""
        return self.put(self.read(name, path, scale, pinned))

    def read(
        self, name: str, path: Path, scale: float = 1.0, pinned: bool = False, root: Path | None = None
    ) -> LoraAdapter:
        """Read and check an adapter file (any thread: it touches no loaded adapter); `path`
        must lie inside `root` when there is one (AddLora: StageConfig.control_root)."""
        check_name(name)
        check_scale(scale)
        return self._read(name, path, scale, pinned, root)

    def put(self, adapter: LoraAdapter) -> LoraInfo:
        """Install a read adapter, replacing an unused one of its name."""
        old = self.adapters.get(adapter.name)
        if old is not None and old.users:
            raise FailedPrecondition(
                f"adapter {adapter.name!r} is in use by {old.users} requests; retry later"
            )
        if old is not None:
            self._drop(old)
        self._install(adapter)
        return self.info(adapter)

    def install_if_absent(self, adapter: LoraAdapter) -> None:
        """`put`, unless an adapter of its name arrived meanwhile (two requests naming one
        adapter of the directory read it at once; the first installed wins)."""
        if adapter.name not in self.adapters:
            self.put(adapter)

    def remove(self, name: str) -> None:
        adapter = self._get(name)
        if adapter.users:
            raise FailedPrecondition(f"adapter {name!r} is in use by {adapter.users} requests; retry later")
        self._drop(adapter)

    def pin(self, name: str, pinned: bool) -> LoraInfo:
        """A pinned adapter is never evicted."""
        adapter = self._get(name)
        adapter.pinned = pinned
        return self.info(adapter)

    def infos(self) -> list[LoraInfo]:
        return [self.info(adapter) for adapter in self.adapters.values()]

    @staticmethod
    def info(adapter: LoraAdapter) -> LoraInfo:
        return LoraInfo(
            name=adapter.name,
            source=adapter.source,
            scale=adapter.scale,
            rank=adapter.rank,
            modules=len(adapter.layers),
            nbytes=adapter.nbytes,
            pinned=adapter.pinned,
            users=adapter.users,
        )

    @property
    def nbytes(self) -> int:
        return sum(adapter.nbytes for adapter in self.adapters.values())

    # -- requests ------------------------------------------------------------------------------

    def acquire(self, loras: Sequence[tuple[str, float | None]]) -> RowAdapters:
        """The adapters a request names, held until `release`; one not loaded comes from the
        adapter directory when there is one, else NOT_FOUND."""
        held: list[tuple[LoraAdapter, float]] = []
        try:
            for name, scale in loras:
                adapter = self.adapters.get(name)
                if adapter is None:
                    adapter = self._load_on_demand(name)
                adapter.users += 1
                adapter.last_used = time.monotonic()
                held.append((adapter, adapter.scale if scale is None else scale))
        except BaseException:
            self.release(tuple(held))
            raise
        return tuple(held)

    def release(self, held: RowAdapters) -> None:
        for adapter, _ in held:
            adapter.users -= 1

    @contextmanager
    def rows(self, rows: Sequence[RowAdapters]) -> Iterator[None]:
        """Apply each row's adapters in the forwards inside (rows = the batch's dimension 0).
        A batch without any adapter is left alone (the hooks return at once)."""
        self._rows = list(rows) if any(rows) else None
        self._slots = None
        if self._rows is not None and any(row != rows[0] for row in rows):
            # Position j: the rows with a j-th adapter, and that adapter and its weight for each.
            slots = []
            for j in range(max(len(row) for row in rows)):
                members = [(i, row[j]) for i, row in enumerate(rows) if len(row) > j]
                rows_j, adapters_j = tuple(i for i, _ in members), tuple(member for _, member in members)
                slots.append(AdapterPosition(rows_j, adapters_j))
            self._slots = slots
        try:
            yield
        finally:
            self._rows, self._slots = None, None

    @property
    def active(self) -> bool:
        """Whether the current forward applies adapters (it must run eagerly: see the runner)."""
        return self._rows is not None

    # -- internals -----------------------------------------------------------------------------

    def _get(self, name: str) -> LoraAdapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise NotFound(f"no adapter {name[:80]!r} is loaded; loaded: {', '.join(self.names) or 'none'}")
        return adapter

    def _load_on_demand(self, name: str) -> LoraAdapter:
        adapter = self.read_from_directory(name)
        self._install(adapter)
        return adapter

    def read_from_directory(self, name: str) -> LoraAdapter:
        """Read adapter `name` from the adapter directory (any thread: a request's adapters
        are read off the compute thread before it is prepared, Worker.preload_loras). The
        name and every entry the directory hands out resolve inside it: a symlink leading
        out, like a missing adapter, is NOT_FOUND."""
        check_name(name)
        if self.directory is None:
            raise NotFound(
                f"adapter {name!r} is not loaded on this replica (and it has no adapter directory)"
            )
        missing = NotFound(f"adapter {name!r} is neither loaded nor in this replica's adapter directory")
        for candidate in (f"{name}.safetensors", name):
            try:
                path = local_path(candidate, "LoRA adapter", self.directory)
            except NotFound:
                continue
            return self._read(name, path, 1.0, False, self.directory)
        raise missing

    def _read(self, name: str, path: Path, scale: float, pinned: bool, root: Path | None) -> LoraAdapter:
        file = adapter_file(path, root)
        tensors, metadata = read_safetensors(file, lambda header: self._check_size(name, header))
        alpha = lora_alpha(metadata)
        try:
            converted = self.reader(tensors)
        except (ValueError, KeyError) as err:
            raise InvalidArgument(f"adapter {name!r} is not a LoRA file this model takes: {err}") from None
        layers = checked_layers(name, converted, self.targets, self.device, self.dtype)
        nbytes = sum(a.nbytes + b.nbytes for a, b in layers.values())
        return LoraAdapter(
            name=name,
            source=file.name,
            scale=scale,
            lora_alpha=alpha,
            layers=layers,
            nbytes=nbytes,
            rank=max(a.shape[0] for a, _ in layers.values()),
            pinned=pinned,
        )

    def _check_size(self, name: str, header: SafetensorsHeader) -> None:
        """RESOURCE_EXHAUSTED, from the header alone, for an adapter larger than the adapter
        memory once in the model's dtype: an absurd rank is refused before a byte of it is
        read (and long before anything reaches the device)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        nbytes = sum(entry.numel * itemsize for entry in header.tensors.values())
        if nbytes > self.max_bytes:
            raise ResourceExhausted(
                f"adapter {name!r} would take {nbytes} bytes; the adapter memory is {self.max_bytes} bytes"
            )

    def _install(self, adapter: LoraAdapter) -> None:
        """Add it, then evict least recently used adapters (unpinned, unused) over the bound;
        when it still does not fit it is taken out again: RESOURCE_EXHAUSTED."""
        self.adapters[adapter.name] = adapter
        for path in adapter.layers:
            self._uses[path] = self._uses.get(path, 0) + 1
            if path not in self._hooks:
                self._hooks[path] = self.targets[path].register_forward_hook(self._hook(path))
        idle = sorted(
            (a for a in self.adapters.values() if a is not adapter and not a.pinned and not a.users),
            key=lambda a: a.last_used,
        )
        while self.nbytes > self.max_bytes and idle:
            self._drop(idle.pop(0))
        self.names = tuple(self.adapters)
        if self.nbytes > self.max_bytes:
            self._drop(adapter)
            raise ResourceExhausted(
                f"adapter {adapter.name!r} ({adapter.nbytes} bytes) does not fit the adapter memory "
                f"({self.max_bytes} bytes; {self.nbytes} held by pinned or busy adapters)"
            )

    def _drop(self, adapter: LoraAdapter) -> None:
        if self.adapters.get(adapter.name) is not adapter:
            return
        del self.adapters[adapter.name]
        self._stacks.clear()  # they hold its factors (and an id another adapter may take)
        for path in adapter.layers:
            self._uses[path] -= 1
            if not self._uses[path]:
                del self._uses[path]
                self._hooks.pop(path).remove()
        self.names = tuple(self.adapters)

    def _hook(
        self, path: str
    ) -> Callable[[torch.nn.Module, tuple[torch.Tensor, ...], torch.Tensor], torch.Tensor | None]:
        def apply(
            module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], result: torch.Tensor
        ) -> torch.Tensor | None:
            rows = self._rows
            if rows is None:
                return None
            return self._apply(path, inputs[0], result, rows)

        return apply

    @staticmethod
    def _delta(
        x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, adapter: LoraAdapter, weight: float
    ) -> torch.Tensor:
        """PEFT's LoRA term `lora_B(lora_A(x)) * scaling`, its scaling the set_adapters weight x
        lora_alpha / r, computed in PEFT's order (the same float)."""
        rank = a.shape[0]
        alpha = rank if adapter.lora_alpha is None else adapter.lora_alpha
        scaling = weight * alpha / rank
        return torch.nn.functional.linear(torch.nn.functional.linear(x, a), b) * scaling

    def _apply(
        self, path: str, x: torch.Tensor, result: torch.Tensor, rows: list[RowAdapters]
    ) -> torch.Tensor:
        """The layer's output plus each row's adapters, in the row's order. When every row has
        the same adapters: `result + term` per adapter, PEFT's forward exactly. Otherwise one
        batched LoRA forward per adapter position: the rows' factors stacked (ranks padded with
        zeros), two bmm, each row's scaling, added to those rows (equal to the rows' own terms
        up to float rounding)."""
        if x.shape[0] != len(rows):
            raise ValueError(f"LoRA rows: {len(rows)} given for a batch of {x.shape[0]} at {path}")
        if self._slots is None:  # every row alike
            for adapter, weight in rows[0]:
                weights = adapter.layers.get(path)
                if weights is not None:
                    result = result + self._delta(x, *weights, adapter, weight)
            return result
        for number, slot in enumerate(self._slots):
            stacked = self._stacked(path, number, slot)
            if stacked is None:
                continue
            index, a, b, scaling = stacked
            part = x.index_select(0, index)
            flat = part.reshape(part.shape[0], -1, part.shape[-1])
            term = torch.bmm(torch.bmm(flat, a.transpose(1, 2)), b.transpose(1, 2)) * scaling
            # In place: the layer's fresh output; inference only (no autograd here).
            result.index_add_(0, index, term.reshape(*part.shape[:-1], term.shape[-1]))
        return result

    def _stacked(self, path: str, number: int, slot: AdapterPosition) -> Stacked | None:
        """(row index, lora_A [n, r, in], lora_B [n, out, r], scaling [n, 1, 1]) of the slot's
        rows whose adapter adapts `path`; None when none does. Kept while the batch's
        composition repeats (step after step), so a step makes no new device tensors."""
        members = [
            (row, a, w) for row, (a, w) in zip(slot.rows, slot.adapters, strict=True) if path in a.layers
        ]
        if not members:
            return None
        key = (number, *((row, id(adapter), weight) for row, adapter, weight in members))
        cached = self._stacks.get(path)
        if cached is not None and cached[0] == key:
            return cached[1]
        rank = max(adapter.layers[path][0].shape[0] for _, adapter, _ in members)
        a_parts, b_parts, scalings = [], [], []
        for _, adapter, weight in members:
            a, b = adapter.layers[path]
            pad = rank - a.shape[0]
            a_parts.append(torch.nn.functional.pad(a, (0, 0, 0, pad)))  # zero rows: exact
            b_parts.append(torch.nn.functional.pad(b, (0, pad)))
            alpha = a.shape[0] if adapter.lora_alpha is None else adapter.lora_alpha
            scalings.append(weight * alpha / a.shape[0])
        stacked = (
            torch.tensor([row for row, _, _ in members], device=self.device),
            torch.stack(a_parts),
            torch.stack(b_parts),
            torch.tensor(scalings, device=self.device, dtype=self.dtype).view(-1, 1, 1),
        )
        self._stacks[path] = (key, stacked)
        return stacked


@dataclass(frozen=True)
class AdapterPosition:
    """The rows of a mixed batch that have an adapter at one position of their list (their
    first, second, ...), in row order, and that adapter with its weight for each."""

    rows: tuple[int, ...]
    adapters: tuple[tuple[LoraAdapter, float], ...]
