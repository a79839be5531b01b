"""The other process of the CUDA IPC tests: `python -m tests.gpu.ipc_peer ROLE`.

consume:   read a StageState from stdin, import it, check every tensor against `cases`,
           print a JSON report. CUDA IPC tensors must arrive on the GPU without a copy.
no-cuda:   (run with CUDA_VISIBLE_DEVICES="") importing a CudaIpcRef is UNIMPLEMENTED.
produce:   export `cases` for a consumer on this GPU and report the locations chosen
           (run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: all shm, one warning),
           then import the refs in a second transport and check the values.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys

import torch

from omni_common.errors import OmniError, PermissionDenied
from omni_common.transport import Consumer, TensorTransport, gpu_uuid, ipc_namespace
from omnistage.v1 import tensor_pb2


def cases(device: torch.device, big: bool = True) -> dict[str, torch.Tensor]:
    """The tensors every role builds the same way: dtypes incl. bf16, a 0-d, a
    non-contiguous view and (big=True) a 256 MiB one."""
    base = torch.arange(1 << 16, device=device)
    out = {
        "float32": (base.float() * 0.5 - 7).reshape(256, 256),
        "bfloat16": (base % 1000).to(torch.bfloat16).reshape(64, 1024) / 8,
        "float16": (base % 2048).to(torch.float16).reshape(1 << 16) - 1024,
        "int64": base.reshape(2, 4, 8192) * -3,
        "uint8": (base % 256).to(torch.uint8),
        "bool": base % 3 == 0,
        "scalar": torch.tensor(3.25, device=device),
        "strided": (base.float().reshape(256, 256) + 1).t()[:, ::3],
    }
    if big:
        out["big"] = torch.arange(64 << 20, dtype=torch.int32, device=device)  # 256 MiB
    return out


def consume() -> int:
    state = tensor_pb2.StageState.FromString(sys.stdin.buffer.read())
    device = torch.device("cuda", 0)
    tr = TensorTransport()
    torch.cuda.init()
    before = torch.cuda.memory_allocated(device)
    got, _ = asyncio.run(tr.import_state(state))
    allocated = torch.cuda.memory_allocated(device) - before  # a copy would show here
    asyncio.run(tr.finish_imports(got.values()))
    want = cases(device, big="big" in got)
    bad = [
        name
        for name, t in got.items()
        if t.device.type != "cuda" or t.dtype != want[name].dtype or not torch.equal(t, want[name])
    ]
    forged = tensor_pb2.TensorRef()
    forged.CopyFrom(state.tensors[0])
    handle = forged.cuda_ipc.ipc_handle
    forged.cuda_ipc.ipc_handle = handle[:-1] + bytes([handle[-1] ^ 1])
    try:
        tr.import_tensor_sync(forged)
        forged_status = "accepted"
    except PermissionDenied:
        forged_status = "PERMISSION_DENIED"
    print(json.dumps({"names": sorted(got), "bad": bad, "allocated": allocated, "forged": forged_status}))
    del got
    tr.close()
    return 0


def no_cuda() -> int:
    state = tensor_pb2.StageState.FromString(sys.stdin.buffer.read())
    tr = TensorTransport()
    try:
        tr.import_tensor_sync(state.tensors[0])
        outcome = "opened"
    except OmniError as err:
        outcome = f"{err.code.name}: {err.message}"
    print(json.dumps({"cuda": torch.cuda.is_available(), "outcome": outcome}))
    tr.close()
    return 0


def produce() -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    device = torch.device("cuda", 0)
    tensors = cases(device, big=False)
    producer = TensorTransport(inline_threshold=0)
    consumer = TensorTransport()
    try:
        here = Consumer("", ipc_namespace(), gpu_uuid(device))
        state = producer.export_state(tensors, {}, consumer=here)
        got, _ = asyncio.run(consumer.import_state(state))
        bad = [n for n, t in got.items() if not torch.equal(t.to(device), tensors[n])]
        locations = sorted({ref.WhichOneof("location") or "" for ref in state.tensors})
        print(json.dumps({"locations": locations, "bad": bad}))
    finally:
        producer.close()
        consumer.close()
    return 0


if __name__ == "__main__":
    sys.exit({"consume": consume, "no-cuda": no_cuda, "produce": produce}[sys.argv[1]]())
