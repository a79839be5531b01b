"""Per-stage scaling: images/s with 1, 2 and 3 DiT replicas (one encoder, one VAE), and
the time from a DiT replica's death to its requests running again elsewhere.

    python benchmarks/scaling.py [--replicas 1 2 3] [--size 64] [--steps 20] [--concurrency 8]

On one machine the replicas share its cores: more replicas add no compute, they only
split the same CPUs (each replica runs torch with every core). One JSON line per result.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from omni_common.client import AsyncClient
from omni_common.cluster import LocalCluster, loopback_plan
from omni_common.models.qwenimage.fixture import build_tiny_fixture


def emit(**row: object) -> None:
    print(json.dumps({"bench": "scaling", **row}), flush=True)


async def throughput(address: str, size: int, steps: int, concurrency: int, rounds: int) -> float:
    async with AsyncClient(address) as client:
        await client.generate_result("warm", width=size, height=size, steps=steps)

        async def loop(worker: int) -> None:
            for r in range(rounds):
                await client.generate_result(
                    f"p {worker}", width=size, height=size, steps=steps, seed=r, progress_every=steps
                )

        started = time.perf_counter()
        await asyncio.gather(*(loop(w) for w in range(concurrency)))
        return concurrency * rounds / (time.perf_counter() - started)


async def failover_gap(cluster: LocalCluster, size: int, steps: int) -> tuple[float, int, int]:
    """Seconds between the SIGKILL of the DiT replica running a request and the request's
    first denoise step on the other replica; the last step seen before the kill and the
    first after it (resumed from the latest checkpoint, not from the start)."""
    async with AsyncClient(cluster.coordinator) as client:
        killed_at = 0.0
        victim = ""
        moved = False
        last_before = first_after = 0
        async for event in client.events("failover", width=size, height=size, steps=steps, seed=1):
            if event.HasField("stage_started") and event.stage_started.stage == "dit-denoise":
                if not killed_at:
                    victim = event.stage_started.replica
                    await asyncio.sleep(0.3)
                    killed_at = time.perf_counter()
                    name = {p.health_address: p.name for p in cluster.plan}[victim]
                    cluster.processes[name].send_signal(signal.SIGKILL)
                elif event.stage_started.replica != victim:
                    moved = True
            elif event.HasField("step"):
                if not moved:
                    last_before = event.step.step
                elif not first_after:
                    first_after = event.step.step
                    gap = time.perf_counter() - killed_at
        if not first_after:
            raise RuntimeError("the request never resumed on another replica")
        return gap, last_before, first_after


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_fixture(Path(tmp) / "qwen-image-tiny")
        for count in args.replicas:
            plan = loopback_plan(model, replicas={"dit-denoise": count})
            with LocalCluster(plan, log_dir=Path(tmp) / f"logs-{count}") as cluster:
                ips = asyncio.run(
                    throughput(cluster.coordinator, args.size, args.steps, args.concurrency, args.rounds)
                )
                emit(
                    dit_replicas=count,
                    size=args.size,
                    steps=args.steps,
                    concurrency=args.concurrency,
                    images_per_s=round(ips, 3),
                    cores=os.cpu_count(),
                )
        plan = loopback_plan(model, replicas={"dit-denoise": 2})
        with LocalCluster(plan, log_dir=Path(tmp) / "logs-failover") as cluster:
            gap, before, after = asyncio.run(failover_gap(cluster, args.size, 200))
            emit(
                failover="SIGKILL of the DiT replica mid-request",
                seconds_to_next_step=round(gap, 3),
                last_step_before=before,
                first_step_after=after,
            )


if __name__ == "__main__":
    main()
