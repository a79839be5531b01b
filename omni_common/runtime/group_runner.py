"""A replica spread over several devices, as the server process sees it: the replica's only gRPC
endpoint, holding no model. Its StepScheduler batches requests between steps exactly as on one
device, and `GroupRunner` (a StepRunner) sends each prepare, step and finish to the ranks of
its WorkerGroup (worker_group.py); the ranks run each step together (sequence parallel, CFG
parallel) and rank 0 answers with what the scheduler reads. A Step is sent and not waited for:
its answers are read after the next Step went out, so the ranks never wait for the server
between steps (step_scheduler.py, rank.py). Outputs leave through the server's own transport,
as on one device. `GroupWorker` is the replica's Worker.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from omni_common.errors import FailedPrecondition, OmniError, Unimplemented
from omni_common.models.base import (
    GenerationRequest,
    LateFlag,
    StageContext,
    StageModel,
    StageState,
    StepState,
)
from omni_common.models.lora import LoraLayers
from omni_common.runtime import rank_commands as commands
from omni_common.runtime.config import StageConfig
from omni_common.runtime.hot_reload import WeightsLoaded
from omni_common.runtime.memory import Transition
from omni_common.runtime.parallel_mode import COLLECTIVE, ModeLog, ParallelPolicy, choose_mode
from omni_common.runtime.worker import Worker
from omni_common.runtime.worker_group import Sent, WorkerGroup


@dataclass(kw_only=True)
class GroupState(StepState):
    """The server's view of a request whose state lives on `ranks` (as `sid`): every rank for
    the collective modes, one rank otherwise (parallel_mode.py)."""

    sid: int
    key: Hashable
    cost: int
    ranks: tuple[int, ...]
    stepped: Sent | None = None  # its last Step, whose answers may not be read yet

    @property
    def collective(self) -> bool:
        return len(self.ranks) > 1


class GroupRunner:
    """A StepRunner whose every call runs on the group's ranks (rank.py does the work). Each new
    request is placed by choose_mode: on the rank with the fewest states, or on every rank."""

    def __init__(self, group: WorkerGroup, policy: ParallelPolicy | None = None) -> None:
        self.group = group
        self.policy = policy or ParallelPolicy()
        self.modes = ModeLog()
        self._ids = itertools.count()
        self._placed: dict[int, tuple[int, ...]] = {}  # the ranks of each state in flight

    def prepare(self, request: GenerationRequest, inputs: StageState) -> GroupState:
        return self.prepare_among(request, inputs, arriving=0)

    def prepare_among(self, request: GenerationRequest, inputs: StageState, arriving: int) -> GroupState:
        """Prepared first on the least loaded rank (its step cost sizes the choice), then, for a
        collective mode, on the other ranks too. The mode counts the states in flight and the
        `arriving` requests (PlacesRequests): a burst's first request does not spread over the
        ranks its followers would step on."""
        if request.loras:  # the adapters would have to reach every device worker (lora_layers)
            raise Unimplemented(
                "LoRA adapters are not available on a dit-denoise replica over several devices; "
                "send the request to a one-device replica"
            )
        sid, world = next(self._ids), len(self.group.devices)
        held = [sum(rank in ranks for ranks in self._placed.values()) for rank in range(world)]
        first = min(range(world), key=lambda rank: (held[rank], rank))
        command = commands.Prepare(sid, request, dict(inputs.meta))
        prepared = self.group.call(command, inputs.tensors, ranks=[first])[0].reply.value
        assert isinstance(prepared, commands.Prepared)
        batch = 1 + len(self._placed) + max(0, arriving)
        mode = choose_mode(batch, prepared.cost, request.do_true_cfg, world, self.policy)
        self.modes.chose(mode, batch, prepared.cost, request.do_true_cfg)
        ranks: tuple[int, ...] = (first,)
        if mode in COLLECTIVE:
            try:
                self.group.call(command, inputs.tensors, ranks=[r for r in range(world) if r != first])
            except BaseException:
                if not self.group.lost:
                    self.group.call(commands.Release(sid))
                raise
            ranks = tuple(range(world))
        self._placed[sid] = ranks
        return GroupState(
            request=request,
            step_index=0,
            total_steps=prepared.total_steps,
            sid=sid,
            # A collective step and a local one never mix: the local states' keys are apart.
            key=prepared.key if len(ranks) > 1 else ("one rank", prepared.key),
            cost=prepared.cost,
            ranks=ranks,
        )

    def batch_key(self, state: StepState) -> Hashable:
        return _own(state).key

    def step_cost(self, state: StepState) -> int:
        return _own(state).cost

    def step(self, states: Sequence[StepState]) -> None:
        """One Step to every rank holding one of the states (they share a batch key, so all are
        collective or none is), sent and not waited for: each state's step index moves on by
        one here, and its ranks' answers (the index they reached, the NaN flag) are read later
        (`is_finite`), or by the next call that reads answers, which reads the earlier first."""
        batch = [_own(state) for state in states]
        collective = any(state.collective for state in batch)
        ranks = sorted({rank for state in batch for rank in state.ranks})
        sent = self.group.send(commands.Step(tuple(state.sid for state in batch), collective), ranks=ranks)
        for state in batch:
            state.step_index += 1
            state.stepped = sent

    def is_done(self, state: StepState) -> bool:
        return state.step_index >= state.total_steps

    def is_finite(self, state: StepState) -> bool | LateFlag:
        """The NaN flag of the state's last step, read from its ranks' answer once it comes."""
        own = _own(state)
        sent, sid, step = own.stepped, own.sid, own.step_index  # as they are now, not at the read
        return True if sent is None else LateFlag(lambda: self._finite(sent, sid, step))

    def _finite(self, sent: Sent, sid: int, step: int) -> bool:
        for answer in self.group.answers(sent):
            value = answer.reply.value
            assert isinstance(value, commands.Stepped)
            if sid in value.sids:
                at = value.sids.index(sid)
                if value.steps[at] != step:
                    raise OmniError(f"a device worker stepped state {sid} to {value.steps[at]}, not {step}")
                return value.finite[at]
        raise OmniError(f"no device worker holds request state {sid}")

    def preview(self, state: StepState) -> np.ndarray | None:
        own = _own(state)
        tensors = self.group.call(commands.Read(own.sid, "preview"), ranks=own.ranks[:1])[0].tensors
        return tensors["preview"].numpy() if "preview" in tensors else None

    def checkpoint(self, state: StepState) -> StageState | None:
        own = _own(state)
        answer = self.group.call(commands.Read(own.sid, "checkpoint"), ranks=own.ranks[:1])[0]
        meta = answer.reply.value
        return None if meta is None else StageState(answer.tensors, dict(meta))  # type: ignore[call-overload]

    def restore(self, state: StepState, checkpoint: StageState) -> None:
        own = _own(state)
        command = commands.Restore(own.sid, dict(checkpoint.meta))
        answers = self.group.call(command, checkpoint.tensors, ranks=own.ranks)
        state.step_index = int(answers[0].reply.value)  # type: ignore[call-overload]

    def finish(self, state: StepState) -> StageState:
        own = _own(state)
        self._placed.pop(own.sid, None)
        answer = self.group.call(commands.Finish(own.sid), ranks=own.ranks)[0]
        return StageState(answer.tensors, dict(answer.reply.value))  # type: ignore[call-overload]

    def release(self, state: StepState) -> None:
        own = _own(state)
        self._placed.pop(own.sid, None)
        if not self.group.lost:
            self.group.call(commands.Release(own.sid), ranks=own.ranks)

    def forget_cuda_graphs(self) -> None:
        """The ranks keep theirs: what would call this (a sleep, new weights) is refused on a
        replica over several devices."""


def _own(state: StepState) -> GroupState:
    if not isinstance(state, GroupState):
        raise ValueError(f"a device group steps GroupState, not {type(state).__name__}")
    return state


@dataclass
class GroupModel:
    """The server process's stage model: one GroupRunner for its step-wise role."""

    runners: dict[str, GroupRunner]
    group: WorkerGroup


class GroupWorker(Worker):
    """The Worker of a replica spread over `config.devices`: no model in this process, the
    role's runner is the device group. The server process computes nothing itself (its
    `device` is the CPU); StageInfo names the group's devices."""

    def __init__(self, config: StageConfig) -> None:
        self.devices = config.devices
        gpus = [int(device.split(":")[1]) for device in self.devices if device.startswith("cuda:")]
        if gpus and max(gpus) >= torch.cuda.device_count():
            raise SystemExit(
                f"{config.stage}: --devices {','.join(self.devices)} needs {max(gpus) + 1} GPUs; "
                f"this machine has {torch.cuda.device_count()}"
            )
        self.on_lost: Callable[[str], None] | None = None  # set by the server: health, deregister
        super().__init__(replace(config, device="cpu", threads=1))
        self.weight_bytes = self._group().weight_bytes

    @property
    def device_name(self) -> str:
        return ",".join(self.devices)

    def _load_model(self, context: StageContext) -> StageModel:
        steps = [spec for spec in self.role_specs if spec.kind == "steps"]
        if self.family.parallel is None or len(steps) != len(self.role_specs):
            raise SystemExit(
                f"{self.stage}: {self.family.name} does not declare how its DiT splits over devices; "
                "serve it on one device (--device)"
            )
        if len(steps) != 1:
            raise SystemExit(
                f"{self.stage}: a replica over several devices serves one role; pick it with --roles"
            )
        if self.config.offload != "none":
            raise SystemExit(f"{self.stage}: --offload {self.config.offload} is not available with --devices")
        config = self.config
        group = WorkerGroup(replace(config, devices=self.devices), steps[0].name)
        group.on_lost = self._lost
        return GroupModel({steps[0].name: GroupRunner(group, ParallelPolicy.of(config))}, group)

    def _lost(self, reason: str) -> None:
        if self.on_lost is not None:
            self.on_lost(reason)

    async def sleep(self, level: int) -> Transition:
        raise FailedPrecondition(f"{self.stage} over several devices does not sleep")

    def lora_layers(self) -> LoraLayers:
        # The adapters would have to reach every device worker: not built yet.
        raise Unimplemented(f"LoRA adapters are not available on a {self.stage} replica over several devices")

    async def load_weights(self, paths: Sequence[str]) -> WeightsLoaded:
        raise Unimplemented(f"LoadWeights is not available on a {self.stage} replica over several devices")

    async def start_profile(self, name: str) -> Path:
        """The server process's profile (its scheduling and its waits for the ranks) and each
        rank's (its forwards and collectives), into the session's directory and its rank-N/
        (rank.RankProfile). The commands go from the compute thread, the queues' one writer."""
        path = await super().start_profile(name)
        try:
            await self.compute(self._group().call, commands.StartProfile(str(path)))
        except BaseException:
            with contextlib.suppress(Exception):
                await self.compute(self._group().call, commands.StopProfile())
            with contextlib.suppress(Exception):
                await super().stop_profile()
            raise
        return path

    async def stop_profile(self) -> tuple[Path, float]:
        """The server's trace, once written; the ranks' follow in rank-N/ beside it, each
        written by a process of its rank's own while that rank runs no step."""
        try:
            await self.compute(self._group().call, commands.StopProfile())
        finally:
            stopped = await super().stop_profile()
        return stopped

    def _group(self) -> WorkerGroup:
        model = self.model
        assert isinstance(model, GroupModel)
        return model.group

    def close(self) -> None:
        super().close()
        model = self.model
        if isinstance(model, GroupModel):
            model.group.close()
