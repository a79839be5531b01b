"""Which way a tensor travels to its consumer: CUDA IPC > shm > remote fetch (DESIGN.md).

A consumer is described by what it registered (StageInfo: host id, IPC namespace, GPU UUID)
and the coordinator passes on with each stage call. Shared memory needs the same host id.
CUDA IPC needs more: the same host and IPC namespace (the driver's IPC and PyTorch's
bookkeeping live there), the same GPU, and memory from an allocator whose allocations
cudaIpcGetMemHandle can export. When it cannot work, device tensors are staged through host
memory instead, and the reason is logged once per process, not per tensor.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("omnistage.transport")


@dataclass(frozen=True)
class Consumer:
    """The process that will import a producer's tensors, as far as the producer knows it."""

    host_id: str = ""  # "" means the producer's own host
    ipc_namespace: int = 0  # inode of /proc/self/ns/ipc; 0 when unknown
    gpu_uuid: str = ""  # "GPU-..." of its device; "" when it has none (or did not say)


def ipc_namespace() -> int:
    """Inode of this process's IPC namespace (0 when /proc cannot tell)."""
    try:
        return os.stat("/proc/self/ns/ipc").st_ino
    except OSError:
        return 0


def host_id_default() -> str:
    """Id of the shared-memory domain: same id means ShmRefs can be mapped.

    OMNISTAGE_HOST_ID wins; otherwise a hash of the machine id (or hostname) and the IPC
    namespace, so two containers on one machine without a shared /dev/shm differ.
    """
    env = os.environ.get("OMNISTAGE_HOST_ID")
    if env:
        return env
    try:
        machine = Path("/etc/machine-id").read_text().strip()
    except OSError:
        machine = ""
    raw = f"{machine or socket.gethostname()}:{ipc_namespace()}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


@functools.cache
def _uuid_of_index(index: int) -> str:
    return f"GPU-{torch.cuda.get_device_properties(index).uuid}"


def gpu_uuid(device: torch.device) -> str:
    """The UUID of a CUDA device as nvidia-smi prints it; "" for other devices. Stable across
    processes, unlike the index, which CUDA_VISIBLE_DEVICES renumbers."""
    if device.type != "cuda":
        return ""
    return _uuid_of_index(torch.cuda.current_device() if device.index is None else device.index)


def local_cuda_index(uuid: str) -> int | None:
    """This process's index of the GPU with `uuid`, None when it does not see that GPU."""
    for index in range(torch.cuda.device_count()):
        if _uuid_of_index(index) == uuid:
            return index
    return None


ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def allocator_refusal() -> str | None:
    """Why this process's CUDA allocator settings rule out CUDA IPC, or None.

    Both names of the variable are read and either one is enough to refuse: which one
    PyTorch obeys when both are set has changed between versions, and shm is always safe.
    """
    for var in ALLOC_CONF_VARS:
        for item in os.environ.get(var, "").split(","):
            key, _, value = (part.strip() for part in item.partition(":"))
            if key == "expandable_segments" and value.lower() == "true":
                # Expandable segments are exported as file descriptors through pidfd_getfd,
                # which containers without ptrace rights refuse: the consumer cannot open them.
                return f"{var} sets expandable_segments:True, whose memory CUDA IPC cannot export here"
            if key == "backend" and value == "cudaMallocAsync":
                return f"{var} selects the cudaMallocAsync allocator, which has no CUDA IPC export"
    return None


def ipc_refusal(consumer: Consumer, host_id: str, device: torch.device) -> str | None:
    """Why the consumer's place rules out CUDA IPC for a tensor on `device`, or None."""
    if consumer.host_id not in ("", host_id):
        return "the consumer is on another host"
    if not consumer.gpu_uuid:
        return "the consumer has no GPU"
    if consumer.ipc_namespace and consumer.ipc_namespace != ipc_namespace():
        return "the consumer is in another IPC namespace"
    if consumer.gpu_uuid != gpu_uuid(device):
        return "the consumer is on another GPU"
    return None


_said: set[str] = set()
_said_lock = threading.Lock()


def say_once(reason: str, *, warn: bool = False) -> None:
    """Log a reason for not using CUDA IPC the first time it comes up in this process."""
    with _said_lock:
        if reason in _said:
            return
        _said.add(reason)
    level = logging.WARNING if warn else logging.INFO
    log.log(level, "CUDA tensors go through host memory instead of CUDA IPC: %s", reason)


def use_cuda_ipc(consumer: Consumer, host_id: str, device: torch.device) -> bool:
    """True when a tensor on `device` should go to `consumer` by CUDA IPC; when a CUDA
    tensor cannot, says why (once)."""
    if device.type != "cuda":
        return False
    reason = ipc_refusal(consumer, host_id, device)
    if reason is not None:
        say_once(reason)  # routine: the coordinator, for one, takes results on the CPU
        return False
    reason = allocator_refusal()
    if reason is not None:
        say_once(reason, warn=True)  # a setting that costs every hop a host round trip
        return False
    return True
