"""One device worker process of a replica spread over several devices (worker_group.py starts
one per device): it loads the family's stage model on its device, joins the replica's
torch.distributed group (NCCL on GPUs, gloo on the CPU), applies the family's
SequenceParallelPlan and serves the server process's commands from its ShmQueue.

A request's state (latents, scheduler) lives where the server placed it (parallel_mode.py):
on every rank, for the collective modes (sequence and CFG parallel), where each rank steps it
identically (a forward's prediction is gathered on every rank, so the ranks never diverge) and
rank 0 answers what reads it (checkpoints, previews, the finished latents); or on one rank
(one-device and data-parallel), which steps it alone, as a one-device replica does, and answers
for it. A Step names its states and whether it is collective; each rank steps those it holds.

The commands and their answers are rank_commands.py's.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from omni_common.errors import FailedPrecondition, OmniError
from omni_common.models.base import (
    DenoiserOptions,
    LateFlag,
    StageContext,
    StageState,
    StepRunner,
    StepState,
)
from omni_common.models.capabilities import (
    ConfiguresExecution,
    HoldsCudaGraphs,
    SplitsCfgBranches,
    SpreadsForwards,
)
from omni_common.models.registry import family_for_model_dir
from omni_common.runtime.config import StageConfig
from omni_common.runtime.parallel_mode import ParallelPolicy, spreads
from omni_common.runtime.profiler import StageProfiler
from omni_common.runtime.rank_commands import (
    Finish,
    Mapped,
    Prepare,
    Prepared,
    RankReply,
    Read,
    Ready,
    Release,
    Restore,
    StartProfile,
    Step,
    Stepped,
    Stop,
    StopProfile,
)
from omni_common.runtime.sequence_parallel import SequenceParallel
from omni_common.runtime.shm_queue import ShmQueue
from omni_common.runtime.step_jobs import flags_on_host
from omni_common.runtime.worker import DTYPES, use_matmul_precision

log = logging.getLogger("omnistage.rank")

POLL_S = 1.0  # how often an idle rank checks that its server process is still there
HOLD_POLL_S = 0.0005  # while its last step runs: how often a rank checks whether it has ended
# How long a collective may wait for a peer; a peer gone for longer fails the step (the server
# notices a dead worker within a second and takes the replica out anyway).
COLLECTIVE_TIMEOUT = timedelta(seconds=300)


@dataclass
class StepInFlight:
    """A Step launched on this rank's device and not answered yet. On a GPU the rank answers it
    once it has ended, and launches the next Step first if one came meanwhile: the device runs
    step k+1 right after step k, with no round trip to the server between them."""

    sids: tuple[int, ...]
    steps: tuple[int, ...]
    flags: list[bool | torch.Tensor | LateFlag]  # on the host (pinned copies: valid once ended)
    ended: torch.cuda.Event | None = None  # recorded after the flags' copies (CUDA)

    def done(self) -> bool:
        return self.ended is None or self.ended.query()

    def answer(self, rank: int) -> RankReply:
        try:
            if self.ended is not None:
                self.ended.synchronize()
            return RankReply(rank, Stepped(self.sids, self.steps, tuple(bool(flag) for flag in self.flags)))
        except Exception as err:  # the device failed the step (an asynchronous CUDA error)
            log.exception("rank %d: a step failed on the device", rank)
            return RankReply(rank, code="INTERNAL", error=type(err).__name__)


def rank_main(
    rank: int,
    devices: tuple[str, ...],
    config: StageConfig,
    role: str,
    rendezvous: str,
    inbox: ShmQueue,
    outbox: ShmQueue,
    parent: int,
) -> None:
    """The process's whole life: join, load, serve commands until Stop or the parent is gone."""
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s rank {rank} %(name)s %(levelname)s %(message)s"
    )
    outbox.put(RankReply(rank, Mapped()))  # both queues are mapped here: the server may unlink them
    device = torch.device(devices[rank])
    threads = config.threads or max(1, (os.cpu_count() or 1) // len(devices))
    torch.set_num_threads(threads)
    use_matmul_precision(config.float32_matmul_precision, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=len(devices),
        timeout=COLLECTIVE_TIMEOUT,
    )
    runner: StepRunner | None = None
    profile = RankProfile(rank, device, config)
    try:
        runner, sp, weight_bytes = _load(config, role, device, len(devices))
        outbox.put(RankReply(rank, Ready(str(device), weight_bytes)))
        _serve(rank, runner, sp, (inbox, outbox), parent, profile)
    finally:
        profile.close()
        if isinstance(runner, HoldsCudaGraphs):
            # Graphs holding captured NCCL calls hung the group's teardown on 2 H200s
            # (benchmarks/dit_parallel.py): they go first.
            runner.forget_cuda_graphs()
        dist.destroy_process_group()


def _load(
    config: StageConfig, role: str, device: torch.device, world: int
) -> tuple[StepRunner, SequenceParallel, int]:
    family = family_for_model_dir(config.model_dir)
    plan = family.parallel
    if plan is None:
        raise SystemExit(f"{family.name} does not declare how its DiT splits over devices")
    family.card.check_quantization(family.name, config.quantization)
    options = DenoiserOptions(
        max_batch=config.max_batch,
        attention_backend=config.attention_backend,
        capture_sizes=config.capture_sizes,
        devices=world,
        quantization=config.quantization,
    )
    context = StageContext(device=device, dtype=DTYPES[config.dtype], roles=(role,), denoiser=options)
    model = family.load(config.stage, Path(config.model_dir), context)
    runner = model.runners[role]
    sp = SequenceParallel(model, plan, world)
    if isinstance(runner, ConfiguresExecution):
        _configure(runner, sp, options, config, device)
    weight_bytes = sum(p.numel() * p.element_size() for p in sp.dit.parameters())
    return runner, sp, weight_bytes  # type: ignore[return-value]


def _configure(
    runner: ConfiguresExecution,
    sp: SequenceParallel,
    options: DenoiserOptions,
    config: StageConfig,
    device: torch.device,
) -> None:
    """The DiT's execution, once the hooks are in: its blocks compiled (--compile, auto: on
    GPUs) with the collectives traced inside, and CUDA graphs (--cuda-graphs, auto: on GPUs) as
    a one-device replica has them, for the forwards this rank runs alone (one-device and
    data-parallel requests, a CFG branch on a half of one rank). A sequence-parallel forward
    replays a graph of its own, the all-to-alls inside, that every rank of its group captured
    at the same step (SpreadsForwards). The warm-up runs each shape alone, then spread inside
    the whole group those the replica's policy can spread (parallel_mode.spreads: under auto on
    2 devices, one request from 1024x1024 on), so no request waits for a compile and the start
    compiles no spread forward that no request can take."""
    on_gpu = device.type == "cuda"
    compile_blocks = config.compile == "on" or (config.compile == "auto" and on_gpu)
    # Only a runner that can be told which forwards are spread may hold graphs.
    graphs = on_gpu and config.cuda_graphs != "off" and isinstance(runner, SpreadsForwards)
    if not (compile_blocks or graphs):
        return
    runner.configure(replace(options, compile=compile_blocks, cuda_graphs=graphs))
    if compile_blocks and isinstance(runner, SpreadsForwards):
        world, policy = options.devices, ParallelPolicy.of(config)
        with _collective(runner, sp):
            runner.rehearse(lambda rows, tokens: spreads(rows, tokens, world, policy))


def _serve(
    rank: int,
    runner: StepRunner,
    sp: SequenceParallel,
    queues: tuple[ShmQueue, ShmQueue],
    parent: int,
    profile: RankProfile,
) -> None:
    inbox, outbox = queues
    states: dict[int, StepState] = {}
    held: StepInFlight | None = None  # the last Step, launched and not answered yet

    def send(reply: RankReply, out: dict[str, torch.Tensor] | None = None) -> None:
        outbox.put(reply, out, alive=lambda: os.getppid() == parent)

    def answer(step: StepInFlight) -> None:
        # On a GPU the wait for the step's end is a task of its own in the profile: its kernels
        # run after the Step's launch.
        with profile.task("Answer") if step.ended is not None else contextlib.nullcontext():
            reply = step.answer(rank)
        send(reply)

    while True:
        message = inbox.get(timeout=HOLD_POLL_S if held is not None else POLL_S)
        if message is None:
            if held is not None and held.done():
                answer(held)
                held = None
            elif held is None and os.getppid() != parent:  # the server process is gone: so is this replica
                return
            continue
        command, tensors = message
        if isinstance(command, Stop):
            return
        if held is not None and not isinstance(command, Step):  # answers go in the commands' order
            answer(held)
            held = None
        value: object
        out: dict[str, torch.Tensor] = {}
        try:
            if isinstance(command, StartProfile | StopProfile):
                value = profile.command(command)
            else:
                with profile.task(type(command).__name__):
                    value, out = _run(command, tensors, runner, sp, states, profile.device)
            reply = RankReply(rank, value)
        except OmniError as err:
            reply, out = RankReply(rank, code=err.code.name, error=err.message), {}
        except Exception as err:  # a fault here: the server fails the request, the rank goes on
            log.exception("rank %d: %s failed", rank, type(command).__name__)
            reply, out = RankReply(rank, code="INTERNAL", error=type(err).__name__), {}
        if held is not None:  # this Step is launched: now wait for the one before it
            answer(held)
            held = None
        if not isinstance(reply.value, StepInFlight):
            send(reply, out)
        elif reply.value.done():
            answer(reply.value)
        else:
            held = reply.value


class RankProfile:
    """This rank's share of its replica's profile: a StageProfiler per session, recording the
    commands the rank runs (its steps: forwards, collectives, host waits) into the server
    session's directory, rank-N/."""

    def __init__(self, rank: int, device: torch.device, config: StageConfig) -> None:
        self.rank = rank
        self.device = device
        self.config = config
        self.profiler: StageProfiler | None = None

    def command(self, command: StartProfile | StopProfile) -> str:
        if isinstance(command, StartProfile):
            self.close()  # a session the server lost track of (it made a new directory)
            self.profiler = StageProfiler(
                f"{self.config.stage}-rank{self.rank}",
                self.device,
                command.directory,
                max_seconds=self.config.profile_max_s,
                max_bytes=self.config.profile_max_mb << 20,
            )
            return str(self.profiler.start(f"rank-{self.rank}"))
        if self.profiler is None:
            return ""
        try:
            self.profiler.stop()  # its trace is written by the session's merge process
        except FailedPrecondition:  # dropped while recording: the rank's log says why
            return ""
        return str(self.profiler.root / f"rank-{self.rank}")

    @contextlib.contextmanager
    def task(self, name: str) -> Iterator[None]:
        """A command while profiled: marked "rank NAME" in the trace (benchmarks/rank_profile.py
        reads the Step marks), a segment ended after it (profiler.StageProfiler)."""
        profiler = self.profiler
        if profiler is None:
            yield
            return
        profiler.before_task()
        try:
            with torch.profiler.record_function(f"rank {name}"):
                yield
        finally:
            profiler.after_task()

    def close(self) -> None:
        """Drop a running session and wait for its merges (this thread started it)."""
        if self.profiler is not None:
            self.profiler.close()
            self.profiler = None


def _run(
    command: object,
    tensors: dict[str, torch.Tensor],
    runner: StepRunner,
    sp: SequenceParallel,
    states: dict[int, StepState],
    device: torch.device,
) -> tuple[object, dict[str, torch.Tensor]]:
    """One command on this rank: (the reply's value, its tensors); a Step's is StepInFlight."""
    if isinstance(command, Prepare):
        state = runner.prepare(command.request, StageState(tensors, dict(command.meta)))
        states[command.sid] = state
        return Prepared(runner.batch_key(state), runner.step_cost(state), state.total_steps), {}
    if isinstance(command, Restore):
        runner.restore(states[command.sid], StageState(tensors, dict(command.meta)))
        return states[command.sid].step_index, {}
    if isinstance(command, Step):
        sids = tuple(sid for sid in command.sids if sid in states)
        batch = [states[sid] for sid in sids]
        if command.collective:
            with _collective(runner, sp):
                runner.step(batch)
        elif batch:
            runner.step(batch)  # this rank's own states: the one-device path
        flags = flags_on_host([runner.is_finite(state) for state in batch])
        stepped = StepInFlight(sids, tuple(state.step_index for state in batch), flags)
        if device.type == "cuda":
            stepped.ended = torch.cuda.Event()
            stepped.ended.record()
        return stepped, {}
    if isinstance(command, Read):
        state = states[command.sid]
        if command.what == "preview":
            picture = runner.preview(state)
            return None, {} if picture is None else {"preview": torch.from_numpy(picture)}
        checkpoint = runner.checkpoint(state)
        return (None, {}) if checkpoint is None else (checkpoint.meta, checkpoint.tensors)
    if isinstance(command, Finish):
        output = runner.finish(states.pop(command.sid))
        return output.meta, output.tensors
    if isinstance(command, Release):
        if command.sid in states:
            runner.release(states.pop(command.sid))
        return None, {}
    raise ValueError(f"unknown command {type(command).__name__}")


@contextlib.contextmanager
def _collective(runner: object, sp: SequenceParallel) -> Iterator[None]:
    """Forwards inside spread over every rank: sequence parallel, and the CFG branches on the
    two halves of the ranks where the runner takes them apart (LatentSteps.cfg_branches); the
    runner asks which group each forward spreads over (SpreadsForwards: its graphs by group)."""
    splitter = runner if isinstance(runner, SplitsCfgBranches) else None
    spreader = runner if isinstance(runner, SpreadsForwards) else None
    if splitter is not None:
        splitter.cfg_branches = sp.branches
    if spreader is not None:
        spreader.spread = sp.group_key
    try:
        with sp.use(sp.full):
            yield
    finally:
        if splitter is not None:
            splitter.cfg_branches = None
        if spreader is not None:
            spreader.spread = None
