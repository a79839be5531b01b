"""The device worker processes of a replica spread over several devices (rank.py is one) and the
rings to them: `WorkerGroup` starts one per device, supervises them, sends them commands
(rank_commands.py) through a ShmQueue per rank and direction (tensors as raw bytes in shared
memory, never pickled) and reads their answers. Each rank answers its commands in order; a
command's answers may be read later (`Sent`: a Step is sent and not waited for), and reading
them reads the earlier commands' first, kept for their readers. group_runner.py drives the
group as one step-wise runner.

A worker that dies takes the replica with it: the group stops the other ranks (a step cannot
finish without every rank), requests in flight fail with UNAVAILABLE so the coordinator resumes
them on another replica from their last checkpoint, and the server turns its health
NOT_SERVING, drains (deregistered) and exits with an error for its supervisor to restart it
(`on_lost`, stage_service.serve_stage).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess

import grpc
import torch

from omni_common.errors import OmniError, Unavailable
from omni_common.runtime import rank_commands as commands
from omni_common.runtime.config import StageConfig
from omni_common.runtime.rank import rank_main
from omni_common.runtime.shm_queue import ShmQueue

log = logging.getLogger("omnistage.worker_group")

# Ring sizes in /dev/shm (a message may take half): a prepare carries the prompt embeddings
# (~15 MB at full size with CFG, bf16); ranks answer with latents, checkpoints and previews
# (0.5 MB at 1024x1024 in bf16). 80 MiB a device at most, touched as the rings fill.
TO_RANK_BYTES = 64 << 20
FROM_RANK_BYTES = 16 << 20
POLL_S = 0.2  # how often a wait for the ranks checks that they are all alive
START_TIMEOUT_S = 1800.0  # loading a full-size model on each device


@dataclass(frozen=True)
class Answer:
    """One rank's reply to a command and the tensors that came with it."""

    reply: commands.RankReply
    tensors: dict[str, torch.Tensor]


@dataclass(eq=False)
class Sent:
    """A command sent to `ranks` whose answers are read later (WorkerGroup.answers): each rank
    answers its commands in the order they came, so reading a later command's answers reads the
    earlier ones' first and keeps them here for their own readers."""

    ranks: tuple[int, ...]
    answers: dict[int, Answer] = field(default_factory=dict)


class WorkerGroup:
    """The worker processes of one replica, one per device, and the queues to them."""

    def __init__(self, config: StageConfig, role: str) -> None:
        self.devices = config.devices
        self.lost = ""  # why the group is gone; "" while it serves
        self.on_lost: Callable[[str], None] = lambda reason: None
        context = multiprocessing.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="omnistage-group-")
        rendezvous = os.path.join(self._dir, "rendezvous")
        self.inboxes = [ShmQueue(context, TO_RANK_BYTES, config.shm_dir) for _ in self.devices]
        self.outboxes = [ShmQueue(context, FROM_RANK_BYTES, config.shm_dir) for _ in self.devices]
        self.processes: list[BaseProcess] = []
        self._unread: list[collections.deque[Sent]] = [collections.deque() for _ in self.devices]
        for rank in range(len(self.devices)):
            process = context.Process(
                target=rank_main,
                args=(
                    rank,
                    self.devices,
                    config,
                    role,
                    rendezvous,
                    self.inboxes[rank],
                    self.outboxes[rank],
                    os.getpid(),
                ),
                name=f"{config.stage}-rank{rank}",
                daemon=True,
            )
            process.start()
            self.processes.append(process)
        try:
            self._answers(range(len(self.devices)), START_TIMEOUT_S)  # Mapped
            for queue in [*self.inboxes, *self.outboxes]:
                queue.unlink()  # both sides have it mapped: no death can leak the segment now
            ready = self._answers(range(len(self.devices)), START_TIMEOUT_S)
        except Unavailable:
            self.close()
            raise SystemExit(
                f"{config.stage}: the device workers did not start ({self.lost}); their log says why"
            ) from None
        except BaseException:
            self.close()
            raise
        self.weight_bytes = sum(
            a.reply.value.weight_bytes for a in ready if isinstance(a.reply.value, commands.Ready)
        )
        self._watcher = threading.Thread(target=self._watch, name="worker-group-watch", daemon=True)
        self._watcher.start()
        log.info("%d device workers ready on %s", len(self.devices), ", ".join(self.devices))

    def _alive(self) -> bool:
        return not self.lost and all(process.is_alive() for process in self.processes)

    def _watch(self) -> None:
        """Wait for any worker to exit; then the replica is lost."""
        ended = multiprocessing.connection.wait([process.sentinel for process in self.processes])
        if self.lost:  # closing
            return
        rank = next(i for i, process in enumerate(self.processes) if process.sentinel in ended)
        dead = self.processes[rank]
        dead.join(timeout=5)  # its sentinel fires as it exits, a moment before it can be reaped
        self._lose(f"the worker process on {self.devices[rank]} exited (code {dead.exitcode})")

    def _lose(self, reason: str) -> None:
        if self.lost:
            return
        self.lost = reason
        log.error("device group lost: %s; stopping its other workers", reason)
        for process in self.processes:
            if process.is_alive():
                process.kill()
        self.on_lost(reason)

    def call(
        self,
        command: object,
        tensors: dict[str, torch.Tensor] | None = None,
        ranks: Sequence[int] | None = None,
    ) -> list[Answer]:
        """Send `command` to `ranks` (all by default) and wait for their answers; raises the
        error a rank answered with, UNAVAILABLE once the group is lost."""
        return self.answers(self.send(command, tensors, ranks))

    def send(
        self,
        command: object,
        tensors: dict[str, torch.Tensor] | None = None,
        ranks: Sequence[int] | None = None,
    ) -> Sent:
        """Send `command` to `ranks` (all by default) without waiting for the answers."""
        sent = Sent(tuple(range(len(self.devices)) if ranks is None else ranks))
        if self.lost:
            raise Unavailable(f"this replica lost a device worker ({self.lost}); retry on another replica")
        for rank in sent.ranks:
            try:
                self.inboxes[rank].put(command, tensors, alive=self._alive)
            except BrokenPipeError:
                self._lose(self.lost or f"the worker process on {self.devices[rank]} is gone")
                raise Unavailable(
                    f"this replica lost a device worker ({self.lost}); retry on another replica"
                ) from None
            self._unread[rank].append(sent)
        return sent

    def answers(self, sent: Sent) -> list[Answer]:
        """The answers to `sent`, waited for (and those of the commands sent before it, kept for
        theirs); raises the error a rank answered with, UNAVAILABLE once the group is lost."""
        for rank in sent.ranks:
            while rank not in sent.answers:
                oldest = self._unread[rank][0]
                (oldest.answers[rank],) = self._answers([rank], None, check=False)
                self._unread[rank].popleft()
        answers = [sent.answers[rank] for rank in sent.ranks]
        for answer in answers:
            if answer.reply.code:
                raise _error(answer.reply)
        return answers

    def _answers(self, ranks: Sequence[int], timeout: float | None, check: bool = True) -> list[Answer]:
        """The next answer of each of `ranks`; raises the error one answered with (`check`)."""
        answers: list[Answer] = []
        deadline = None if timeout is None else time.monotonic() + timeout
        for rank in ranks:
            while True:
                message = self.outboxes[rank].get(POLL_S)
                if message is not None:
                    reply, tensors = message
                    assert isinstance(reply, commands.RankReply)
                    answers.append(Answer(reply, tensors))
                    break
                if not self._alive():
                    self._lose(self.lost or f"the worker process on {self.devices[rank]} is gone")
                    raise Unavailable(
                        f"this replica lost a device worker ({self.lost}); retry on another replica"
                    )
                if deadline is not None and time.monotonic() > deadline:
                    raise SystemExit(
                        f"the worker process on {self.devices[rank]} did not start in {timeout:.0f} s"
                    )
        for answer in answers:
            if check and answer.reply.code:
                raise _error(answer.reply)
        return answers

    def close(self) -> None:
        """Stop the workers (Stop, then kill after a grace), free the queues."""
        reason, self.lost = self.lost, self.lost or "closed"
        if not reason:
            for inbox, process in zip(self.inboxes, self.processes, strict=True):
                if process.is_alive():
                    with contextlib.suppress(BrokenPipeError, ValueError):
                        inbox.put(commands.Stop(), alive=process.is_alive)
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        for queue in [*self.inboxes, *self.outboxes]:
            queue.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _error(reply: commands.RankReply) -> OmniError:
    """The error a rank answered with, as the same OmniError class (InvalidArgument, ...)."""
    code = getattr(grpc.StatusCode, reply.code, grpc.StatusCode.INTERNAL)
    if code == grpc.StatusCode.INTERNAL:
        return OmniError(f"internal error in a device worker ({reply.error})")
    kind = next((cls for cls in OmniError.__subclasses__() if cls.code == code), OmniError)
    return kind(reply.error, code)
