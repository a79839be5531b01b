"""Worker base: the infrastructure of one device, shared by every stage.

It picks the device and dtype, sets the thread count, owns the single compute thread (one
model forward at a time per device, so the event loop stays free for RPCs), loads the model
family's stage model with a runner per role this replica serves, drives each runner by its
kind (omni_common.runtime.roles), and owns the device memory of the weights: sleep/wake and
layerwise offload of the modules the family declares. Stage workers
(services/<stage>/worker.py) add what their stage type means: the DiT's execution flags, the
encoder's backend, the decoder's image encodings.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import torch

from omni_common.checked_files import FileReader
from omni_common.errors import FailedPrecondition, InvalidArgument, NotFound, Unimplemented
from omni_common.execution.compile_cache import use_compile_cache
from omni_common.models.base import (
    GenerationRequest,
    ModelFamily,
    RoleSpec,
    StageContext,
    StageModel,
    StageState,
)
from omni_common.models.capabilities import CachesFromWeights, ExportsPrefixes, HoldsCudaGraphs
from omni_common.models.model_defaults import read_model_defaults
from omni_common.models.registry import family_for_model_dir, model_name_for_dir
from omni_common.models.validation import check_takes_loras
from omni_common.runtime.calls import Progress, StageCall
from omni_common.runtime.config import StageConfig
from omni_common.runtime.hot_reload import (
    WeightsLoaded,
    copy_weights,
    planned_copies,
    read_weights,
    weight_shapes,
)
from omni_common.runtime.layerwise_offload import LayerwiseOffload
from omni_common.runtime.lora_control import LoraControl
from omni_common.runtime.memory import StageModules, Transition, WeightSleeper, discover_modules
from omni_common.runtime.profiler import StageProfiler
from omni_common.runtime.roles import RoleHandler, RoleLimits, StepRole, role_handler
from omni_common.runtime.step_scheduler import StepTotals
from omni_common.stages import STAGE_MODULE_ROLES

T = TypeVar("T")
log = logging.getLogger("omnistage.worker")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str) -> torch.device:
    """`auto` takes the first CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"device {name} was asked for but CUDA is not available")
    return device


def use_matmul_precision(setting: str, device: torch.device) -> None:
    """The process's float32 matrix-product precision (StageConfig.float32_matmul_precision):
    `auto` is TensorFloat-32 ("high") on a CUDA device and IEEE float32 ("highest") elsewhere,
    where a CPU's products must stay transformers' own (the CPU parity tests are bitwise)."""
    precision = ("high" if device.type == "cuda" else "highest") if setting == "auto" else setting
    torch.set_float32_matmul_precision(precision)


class Worker(LoraControl):
    """One stage on one device: the family's stage model and a handler per role it serves."""

    def __init__(self, config: StageConfig) -> None:
        self.config = config
        self.stage = config.stage
        self.device = pick_device(config.device)
        self.dtype = DTYPES[config.dtype]
        if config.threads > 0:
            torch.set_num_threads(config.threads)
        use_matmul_precision(config.float32_matmul_precision, self.device)
        self.family: ModelFamily = family_for_model_dir(config.model_dir)
        self.model_name = config.model_name or model_name_for_dir(config.model_dir)
        # Read before the weights load, so a bad omnistage.json stops the stage at once.
        self.model_defaults = read_model_defaults(config.model_dir, self.family.card, self.family.name)
        self.in_flight = 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.stage}-compute")
        # Files that calls name are read here: never on the event loop or the compute thread.
        self.files = FileReader()
        self.control_root = Path(config.control_root) if config.control_root else None
        self.profiler = StageProfiler(
            self.stage,
            self.device,
            config.profile_dir,
            max_seconds=config.profile_max_s,
            max_bytes=config.profile_max_mb << 20,
        )
        self.modules = StageModules({}, [])
        self.weight_bytes = 0
        self.sleeper = WeightSleeper(self.modules, self.device)
        self.layerwise: list[LayerwiseOffload] = []
        self._forget_weight_addresses: Callable[[], None] = lambda: None
        self._memory_lock = asyncio.Lock()  # one sleep/wake at a time, none under a new call
        self.on_memory_change: Callable[[], Awaitable[None]] | None = None  # e.g. health
        self.role_specs = self._served_roles()
        log.info(
            "%s: model %s (%s) on %s in %s, %d threads; roles %s",
            self.stage,
            self.model_name,
            self.family.name,
            self.device_name,  # a replica over several devices names them, not its own CPU
            config.dtype,
            torch.get_num_threads(),
            ", ".join(spec.name for spec in self.role_specs),
        )
        if config.compile_cache:
            use_compile_cache(Path(config.compile_cache))
        context = self.stage_context()
        self.model = self._load_model(context)
        # The latest tensor LoadWeights gave each weight name (host memory, at most one model's
        # worth), applied again when a level-2 wake reloads the model from its directory.
        self.pushed: dict[str, torch.Tensor] = {}
        has_weights = bool(
            discover_modules(self.model, self.family.modules, STAGE_MODULE_ROLES[self.stage]).by_role
        )
        self.manage_memory(
            self.model,
            reload=(lambda: self._reload_model(context)) if has_weights else None,
            forget_weight_addresses=self._forget_cuda_graphs,
        )
        limits = self.role_limits()
        self.handlers: dict[str, RoleHandler] = {
            spec.name: role_handler(spec, self.model.runners[spec.name], self.compute, limits, self.device)
            for spec in self.role_specs
        }

    @property
    def device_name(self) -> str:
        """The device(s) this replica computes on, as StageInfo says it."""
        return str(self.device)

    @property
    def roles(self) -> list[str]:
        """The roles this replica serves, the stage's default (first) one first."""
        return [spec.name for spec in self.role_specs]

    def _served_roles(self) -> list[RoleSpec]:
        offered = [spec for spec in self.family.roles if spec.stage == self.stage]
        wanted = self.config.roles
        unknown = sorted(set(wanted) - {spec.name for spec in offered})
        if unknown:
            raise SystemExit(
                f"{self.stage}: {self.family.name} has no {self.stage} role {unknown[0]!r}; "
                f"its roles here: {', '.join(spec.name for spec in offered) or 'none'}"
            )
        served = [spec for spec in offered if not wanted or spec.name in wanted]
        if not served:
            raise SystemExit(f"{self.stage}: model family {self.family.name} has no roles on this stage")
        return served

    def stage_context(self) -> StageContext:
        """What the family's loader gets; stage workers add their stage's options."""
        config = self.config
        return StageContext(
            device=self.device,
            dtype=self.dtype,
            roles=tuple(spec.name for spec in self.role_specs),
            batch_window_s=config.batch_window_ms / 1e3,
            max_batch=config.max_batch,
            max_queue=config.max_queue,
            compute=self.compute,
        )

    def compile_flag(self) -> bool:
        """`--compile`: auto is on for a CUDA device (the stages' compiled paths are measured
        there: docs/benchmarks.md)."""
        value = self.config.compile
        if value == "on" and self.device.type != "cuda":
            raise SystemExit(f"{self.stage}: --compile on needs a CUDA device")
        return value == "on" or (value == "auto" and self.device.type == "cuda")

    def execution_flag(self, name: str, value: str) -> bool:
        """An auto/on/off flag of a path that holds the weights' addresses (CUDA graphs, the
        DiT's compiled blocks): auto is on for a CUDA device without layerwise offload, whose
        per-layer copies neither a graph nor a compiled block may bake in."""
        possible = self.device.type == "cuda" and self.config.offload != "layerwise"
        if value == "on" and not possible:
            raise SystemExit(f"{self.stage}: {name} on needs a CUDA device and no layerwise offload")
        return value == "on" or (value == "auto" and possible)

    def role_limits(self) -> RoleLimits:
        config = self.config
        return RoleLimits(
            max_batch=config.max_batch,
            max_queue=config.max_queue,
            batch_window_s=config.batch_window_ms / 1e3,
            max_step_cost=config.max_tokens,
        )

    def _load_model(self, context: StageContext) -> StageModel:
        model = self.family.load(self.stage, self.config.model_dir, context)
        missing = [spec.name for spec in self.role_specs if spec.name not in model.runners]
        if missing:
            raise SystemExit(f"{self.stage}: {self.family.name} loaded no runner for role {missing[0]!r}")
        return model

    def _reload_model(self, context: StageContext) -> StageModel:
        """The model as sleep level 2 wakes it: loaded again from its directory, then the latest
        weights LoadWeights put in (kept in host memory for this)."""
        model = self._load_model(context)
        modules = discover_modules(model, self.family.modules, STAGE_MODULE_ROLES[self.stage])
        if self.pushed:
            copy_weights(planned_copies(modules.by_role[STAGE_MODULE_ROLES[self.stage]], self.pushed))
        return model

    def _copy_weights(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> WeightsLoaded:
        """copy_weights, then each runner drops what it computed from the old values
        (CachesFromWeights), before any later step runs."""
        done = copy_weights(pairs)
        for runner in self.model.runners.values():
            if isinstance(runner, CachesFromWeights):
                runner.weights_changed()
        return done

    def _forget_cuda_graphs(self) -> None:
        for runner in self.model.runners.values():
            if isinstance(runner, HoldsCudaGraphs):
                runner.forget_cuda_graphs()

    def load(self) -> int:
        """The stage's load signal for routing: the sum of its roles' work."""
        return sum(handler.load() for handler in self.handlers.values())

    def step_totals(self) -> dict[str, StepTotals]:
        """Steps and their device and idle time, by step-wise role (metrics)."""
        return {name: h.totals for name, h in self.handlers.items() if isinstance(h, StepRole)}

    def validate(self, request: GenerationRequest) -> None:
        check_takes_loras(request, self.family.card, self.family.name)
        self.family.validate(request)

    def handler(self, role: str) -> RoleHandler:
        """The handler of `role` ("" = the stage's default role); NOT_FOUND for one not served."""
        handler = self.handlers.get(role or self.roles[0])
        if handler is None:
            raise NotFound(
                f"this {self.stage} replica serves roles {', '.join(self.roles)}, not {role[:50]!r}"
            )
        return handler

    async def run(self, call: StageCall) -> AsyncIterator[Progress | StageState]:
        """Progress events, then one StageState holding at least `call.outputs` (all when empty)."""
        handler = self.handler(call.role)
        if call.export_prefix:
            yield await self._export_prefix(call)
            return
        if call.inbox is not None and not handler.streams:
            raise InvalidArgument(f"role {call.role or self.roles[0]!r} does not take streamed inputs")
        if call.request.loras:
            await self.preload_loras([name for name, _ in call.request.loras])
        async for item in handler.run(call):
            yield item

    async def _export_prefix(self, call: StageCall) -> StageState:
        """The role's kept prefix KV of `call`'s prompt, read on the compute thread (between
        the role's steps, which write that cache)."""
        runner = self.model.runners[call.role or self.roles[0]]
        if not isinstance(runner, ExportsPrefixes):
            raise InvalidArgument(f"role {call.role or self.roles[0]!r} keeps no prefixes to export")
        return await self.compute(runner.export_prefix, call.request, call.inputs)

    def manage_memory(
        self,
        runner: object,
        reload: Callable[[], object] | None = None,
        forget_weight_addresses: Callable[[], None] | None = None,
    ) -> None:
        """Find the runner's modules from the family's declaration, for sleep/wake and (with
        `--offload layerwise`) layerwise offload. `reload` builds a fresh runner (sleep level 2);
        `forget_weight_addresses` drops what holds the weights' device addresses (CUDA
        graphs), called once they have left the device: a wake puts them elsewhere."""
        if forget_weight_addresses is not None:
            self._forget_weight_addresses = forget_weight_addresses
        role = STAGE_MODULE_ROLES[self.stage]
        self.modules = discover_modules(runner, self.family.modules, role)
        self.weight_bytes = self.modules.weight_bytes()

        def reloaded() -> dict[str, torch.Tensor]:
            assert reload is not None
            return dict(discover_modules(reload(), self.family.modules, role).named_weights())

        self.sleeper = WeightSleeper(self.modules, self.device, reload=reloaded if reload else None)
        if self.config.offload == "layerwise":
            self.layerwise = [LayerwiseOffload(blocks, self.device) for _, blocks in self.modules.layers]
            for (path, _), offload in zip(self.modules.layers, self.layerwise, strict=True):
                log.info(
                    "%s: %s offloaded layerwise, %.1f MB per block",
                    self.stage,
                    path,
                    offload.block_bytes / 1e6,
                )

    @property
    def awake(self) -> bool:
        return self.sleeper.awake

    @property
    def device_memory_bytes(self) -> int:
        if self.device.type != "cuda":
            return 0
        return int(torch.cuda.get_device_properties(self.device).total_memory)

    async def sleep(self, level: int) -> Transition:
        """Free the device memory of the weights (level 1: to host memory; 2: dropped)."""
        if level not in (1, 2):
            raise InvalidArgument(f"sleep level is {level}; it must be 1 or 2")
        if level == 2 and self.sleeper.reload is None:
            raise InvalidArgument(f"{self.stage} cannot reload its weights; use sleep level 1")
        if level == 2 and self.layerwise:
            raise InvalidArgument("layerwise offload keeps the blocks in host memory; use sleep level 1")
        async with self._memory_lock:
            if self.in_flight:
                raise FailedPrecondition(
                    f"{self.stage} has {self.in_flight} calls in flight; it can sleep once they finish"
                )
            done = await self.compute(self.sleeper.sleep, level)
            await self.compute(self._forget_weight_addresses)
        await self._changed()
        if done.nbytes:
            log.info(
                "%s: asleep (level %d), %.1f MB in %.3f s", self.stage, level, done.nbytes / 1e6, done.seconds
            )
        return done

    async def wake(self) -> Transition:
        async with self._memory_lock:
            done = await self.compute(self.sleeper.wake)
        await self._changed()
        if done.nbytes:
            log.info("%s: awake, %.1f MB in %.3f s", self.stage, done.nbytes / 1e6, done.seconds)
        return done

    async def _changed(self) -> None:
        if self.on_memory_change is not None:
            await self.on_memory_change()

    async def ensure_awake(self) -> None:
        """Wake before serving a call (when the offload policy did not)."""
        if not self.sleeper.awake or self._memory_lock.locked():
            await self.wake()

    # -- weight pushes and the profiler (StageControl; LoRA adapters: lora_control.py) -------

    async def load_weights(self, paths: Sequence[str]) -> WeightsLoaded:
        """Copy new weights into the model between two steps (hot_reload.py)."""
        if self.layerwise:
            raise FailedPrecondition(
                "layerwise offload keeps the blocks in host memory; LoadWeights needs them resident"
            )
        modules = self.modules.by_role.get(STAGE_MODULE_ROLES[self.stage], [])
        if not modules:
            raise Unimplemented(f"this {self.stage} replica declares no weights to load")
        self._check_awake()
        shapes = await self.compute(weight_shapes, modules)
        tensors = await self.files.run(read_weights, paths, shapes, self.control_root)
        async with self._memory_lock:
            self._check_awake()  # shapes are checked against the weights on the device
            pairs = await asyncio.to_thread(planned_copies, modules, tensors)
            done = await self.compute(self._copy_weights, pairs)
            self.sleeper.drop_host_copy()  # a level-1 sleep copies the new weights again
            if self.sleeper.reload is not None:
                self.pushed.update(tensors)
        log.info(
            "%s: %d weight tensors (%.1f MB) loaded in %.3f s",
            self.stage,
            done.tensors,
            done.nbytes / 1e6,
            done.seconds,
        )
        return done

    def _check_awake(self) -> None:
        if not self.sleeper.awake:
            raise FailedPrecondition(f"{self.stage} is asleep; wake it before loading weights")

    async def start_profile(self, name: str) -> Path:
        return await self.compute(self.profiler.start, name)

    async def stop_profile(self) -> tuple[Path, float]:
        """End the recording's last segment on the compute thread; a process of its own joins
        the segments into the trace while the next steps run (profiler.py)."""
        written, seconds = await self.compute(self.profiler.stop)
        return await asyncio.wrap_future(written), seconds

    async def compute(self, fn: Callable[..., T], *args: object) -> T:
        """Run model work on the device's compute thread without blocking the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._bounded, fn, args)

    def _bounded(self, fn: Callable[..., T], args: tuple[object, ...]) -> T:
        """`fn(*args)`, then a running profile ends its segment or stops at its bounds (the
        compute thread is where the profiler records); a profile's merge pauses meanwhile."""
        self.profiler.before_task()
        try:
            return fn(*args)
        finally:
            self.profiler.after_task()

    def close(self) -> None:
        for handler in self.handlers.values():
            handler.close()
        if self.profiler.running:  # ended by the thread that records it, before that ends
            self._executor.submit(self.profiler.close).result()
        self._executor.shutdown(wait=True, cancel_futures=True)
        self.files.close()
        self.profiler.close()
        for offload in self.layerwise:
            offload.close()
