"""One inter-stage hop of a GPU tensor, by transport: CUDA IPC vs shm staging vs chunked fetch.

The producer is this process, the consumer a spawned process on the same GPU. A hop is what
a stage pays between its output and the next stage's first use of it, end to end: export
in the producer (CUDA IPC: a device clone and the handle; shm: a copy to the host arena;
fetch: the same copy, then chunks over gRPC), the ref handed over a pipe, the import in the
consumer (CUDA IPC: the mapping; shm: the mapping and a copy to the GPU; fetch: the pull and
a copy to the GPU), and a first use: a bf16 sum over every element, read back on the host.
Issue 8's target: the CUDA IPC hop under 1 ms whatever the size.

    python benchmarks/cuda_ipc.py [--sizes-mib 1 64 256] [--reps 10]

Prints one JSON line per (size, transport): hop_ms (median and best), and the medians of
its parts: export_ms (producer), open_ms and first_use_ms (consumer), and pipe_ms, the
round trip of an empty message over the same pipe, which every hop includes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import time
from multiprocessing.connection import Connection

import torch

# The producer of benchmarks/transport.py: a transport whose TensorStore serves fetches.
from transport import Producer

from omni_common.transport import Consumer, TensorTransport, gpu_uuid, ipc_namespace
from omnistage.v1 import tensor_pb2

TRANSPORTS = ("cuda_ipc", "shm", "fetch")


def consumer(conn: Connection, device_index: int) -> None:
    """Child: import each state it is sent, use the tensor on the GPU, report the times."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)  # gRPC channels bind to the loop current at creation
    device = torch.device("cuda", device_index)
    torch.cuda.init()
    tr = TensorTransport()
    while (msg := conn.recv()) is not None:
        if msg == b"":
            conn.send(None)  # pipe round trip
            continue
        state = tensor_pb2.StageState.FromString(msg)
        start = time.perf_counter()
        tensors, _ = loop.run_until_complete(tr.import_state(state))
        t = tensors["x"].to(device)  # a no-op for CUDA IPC: it is on the GPU already
        opened = time.perf_counter()
        t.sum(dtype=torch.float32).item()  # waits for the producer's data, reads all of it
        used = time.perf_counter()
        del tensors, t
        conn.send((opened - start, used - opened))
    tr.close()


def answer(conn: Connection) -> tuple[float, float] | None:
    if not conn.poll(120):
        raise TimeoutError("the consumer process did not answer")
    reply: tuple[float, float] | None = conn.recv()
    return reply


def hop(p: Producer, conn: Connection, t: torch.Tensor, to: Consumer) -> tuple[float, float, float, float]:
    """(hop, export, open, first use) in seconds."""
    start = time.perf_counter()
    state = p.tr.export_state({"x": t}, {}, consumer=to)
    exported = time.perf_counter()
    conn.send(state.SerializeToString())
    reply = answer(conn)
    end = time.perf_counter()
    p.tr.release(p.tr.lease_ids(state))  # off the clock: releases run in the background
    assert reply is not None
    return end - start, exported - start, reply[0], reply[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", type=int, nargs="*", default=[1, 64, 256])
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/cuda_ipc.py needs a CUDA GPU: torch.cuda.is_available() is False here")
    device = torch.device("cuda", torch.cuda.current_device())
    here = Consumer("", ipc_namespace(), gpu_uuid(device))
    consumers = {
        "cuda_ipc": here,
        "shm": Consumer("", ipc_namespace(), ""),  # no GPU named: staged through the arena
        "fetch": Consumer("elsewhere"),  # another host: chunks over gRPC
    }
    p = Producer()
    ctx = mp.get_context("spawn")  # CUDA cannot be forked
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=consumer, args=(child, device.index), daemon=True)
    proc.start()
    try:
        pipe = []
        for _ in range(20):
            start = time.perf_counter()
            parent.send(b"")
            answer(parent)
            pipe.append(time.perf_counter() - start)
        pipe_ms = statistics.median(pipe) * 1e3
        for mib in args.sizes_mib:
            t = torch.randn(mib << 19, device=device).to(torch.bfloat16)  # mib MiB of bf16
            for name in TRANSPORTS:
                for _ in range(2):  # warm-up: channel, first mappings, allocator pools
                    hop(p, parent, t, consumers[name])
                runs = [hop(p, parent, t, consumers[name]) for _ in range(args.reps)]
                hops, exports, opens, uses = (list(column) for column in zip(*runs, strict=True))
                row = {
                    "bytes": t.nbytes,
                    "transport": name,
                    "hop_ms_p50": round(statistics.median(hops) * 1e3, 3),
                    "hop_ms_best": round(min(hops) * 1e3, 3),
                    "export_ms": round(statistics.median(exports) * 1e3, 3),
                    "open_ms": round(statistics.median(opens) * 1e3, 3),
                    "first_use_ms": round(statistics.median(uses) * 1e3, 3),
                    "pipe_ms": round(pipe_ms, 3),
                    "device": torch.cuda.get_device_name(device),
                }
                print(json.dumps(row), flush=True)
            del t
    finally:
        parent.send(None)
        proc.join(30)
        p.close()


if __name__ == "__main__":
    main()
