"""Tensor transport throughput: inline gRPC vs shm handle vs chunked Fetch vs memcpy.

The producer is this process; the consumer is a separate (spawned) process, and each
timing is end to end: export in the producer, hand the ref over, the tensor usable in the
consumer, ack back. From 1 MiB the shm consumer maps the region copy-on-write instead of
copying it, so `shm_handle_read` also has the consumer read every byte once, as a real
stage does. memcpy copies the tensor into a preallocated, already touched buffer of the
same size in this process: the memory bandwidth, without allocation or page faults.

    python benchmarks/transport.py [--quick] [--sizes-kib 65536 ...]

Prints one JSON line per (size, method): bytes, gbps (best of N), ratio to memcpy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import threading
import time
from multiprocessing.connection import Connection

import grpc
import torch

from omni_common.net.rpc import aio_channel, aio_server
from omni_common.transport import (
    Consumer,
    TensorTransport,
    add_tensor_store,
    decode_inline,
    encode_inline,
)
from omnistage.v1 import tensor_pb2

INLINE_LIMIT = 32 << 20  # one message must fit under MAX_MESSAGE_BYTES (64 MiB)
INLINE_METHOD = "/bench.Inline/Get"


def consumer(conn: Connection, address: str) -> None:
    """Child: import whatever ref it is sent, ack with the byte count."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)  # the channel binds to the loop current at creation
    tr = TensorTransport()
    channel = aio_channel(address)
    get = channel.unary_unary(INLINE_METHOD, response_deserializer=tensor_pb2.TensorRef.FromString)

    async def inline() -> torch.Tensor:
        return decode_inline(await get(b""), 1 << 33)

    while True:
        msg = conn.recv()
        if msg is None:
            break
        method, payload = msg
        if method == "inline":
            t = loop.run_until_complete(inline())
        else:
            state = tensor_pb2.StageState.FromString(payload)
            t = loop.run_until_complete(tr.import_state(state))[0]["x"]
            if method == "state_read":  # a real consumer reads its input: touch every byte
                flat = t.view(torch.uint8)
                flat[: flat.numel() // 8 * 8].view(torch.int64).max()  # memory-bound, unlike a uint8 sum
        conn.send(t.numel() * t.element_size())
    tr.close()


class Producer:
    """This process: a TensorStore + inline-bytes server on a background event loop."""

    def __init__(self) -> None:
        self.tr = TensorTransport(inline_threshold=0, segment_bytes=512 << 20)
        self.current = torch.empty(0)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result()

    async def _start(self) -> None:
        self.server = aio_server()
        add_tensor_store(self.server, self.tr)

        async def get(_: bytes, __: grpc.aio.ServicerContext) -> tensor_pb2.TensorRef:
            return encode_inline("x", self.current)

        handler = grpc.unary_unary_rpc_method_handler(
            get, response_serializer=tensor_pb2.TensorRef.SerializeToString
        )
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("bench.Inline", {"Get": handler}),)
        )
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.tr.address = f"127.0.0.1:{port}"
        await self.server.start()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(None), self.loop).result()
        self.tr.close()


def ack(conn: Connection) -> None:
    if not conn.poll(120):
        raise TimeoutError("consumer process did not answer")
    conn.recv()


def one_transfer(p: Producer, conn: Connection, method: str, t: torch.Tensor) -> float:
    start = time.perf_counter()
    if method == "inline_grpc":
        p.current = t
        conn.send(("inline", b""))
        ack(conn)
    else:
        host = "elsewhere" if method == "fetch_grpc" else ""
        state = p.tr.export_state({"x": t}, {}, consumer=Consumer(host))
        kind = "state_read" if method == "shm_handle_read" else "state"
        conn.send((kind, state.SerializeToString()))
        ack(conn)
        p.tr.release(p.tr.lease_ids(state))
    return time.perf_counter() - start


def best(fn, reps: int) -> float:
    fn()  # warm-up: first touch of pages, channel setup
    return min(fn() for _ in range(reps))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--sizes-kib", type=int, nargs="*", help="sizes to run (default 1 KiB .. 256 MiB)")
    args = ap.parse_args()
    reps = 3 if args.quick else 10
    sizes = [k << 10 for k in args.sizes_kib] if args.sizes_kib else [1 << (10 + 2 * i) for i in range(10)]
    p = Producer()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=consumer, args=(child, p.tr.address), daemon=True)
    proc.start()
    try:
        for size in sizes:
            t = torch.randint(0, 256, (size,), dtype=torch.uint8)
            r = reps if size <= (16 << 20) else max(2, reps // 3)

            destination = torch.zeros_like(t)

            def memcpy(t: torch.Tensor = t, destination: torch.Tensor = destination) -> float:
                s = time.perf_counter()
                destination.copy_(t)
                return time.perf_counter() - s

            base = best(memcpy, r)
            rows = [("memcpy", base)]
            for method in ("inline_grpc", "shm_handle", "shm_handle_read", "fetch_grpc"):
                if method == "inline_grpc" and size > INLINE_LIMIT:
                    continue
                rows.append((method, best(lambda m=method, t=t: one_transfer(p, parent, m, t), r)))
            for method, sec in rows:
                print(
                    json.dumps(
                        {
                            "bytes": size,
                            "method": method,
                            "gbps": round(size / sec / 1e9, 3),
                            "ratio_to_memcpy": round(base / sec, 3),
                        }
                    ),
                    flush=True,
                )
    finally:
        parent.send(None)
        proc.join(30)
        p.close()


if __name__ == "__main__":
    main()
