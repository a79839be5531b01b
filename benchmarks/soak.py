"""Soak under chaos: N requests at concurrency C through a local cluster (real processes, the
digits model, two replicas of every stage) while a chaos thread SIGKILLs a random stage
replica every few seconds and starts it again.

    python benchmarks/soak.py [--requests 2000] [--concurrency 8] [--kill-every 5] [--replica-wait 120]

Reports requests lost (any that did not return an image), p50/p99 latency, every process's
RSS after warm-up and at the end, and the shared-memory segments left after the cluster
stopped. The competitor is the same load without chaos, in the same run (its p99 is the
baseline the chaos run's p99 is read against).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from omni_common.client import Client
from omni_common.cluster import LocalCluster, loopback_plan, stage_process
from omni_common.errors import OmniError
from omni_common.stages import STAGES

SHM = Path("/dev/shm")
REQUEST = {"width": 32, "height": 32, "steps": 8}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def segments() -> set[str]:
    return {p.name for p in SHM.glob("omnistage-*")}


def run(args: argparse.Namespace, chaos: bool, log_dir: Path) -> dict[str, object]:
    # A stage whose replicas are all down makes requests wait for one (the coordinator's
    # --replica-wait): on 2 shared cores a replacement takes 10-30 s to start.
    wait = {"OMNISTAGE_REPLICA_WAIT_S": str(args.replica_wait)}
    plan = loopback_plan(args.model, replicas={stage: 2 for stage in STAGES}, extra_env=wait)
    before = segments()
    latencies: list[float] = []
    failures: list[str] = []  # requests that got no image
    restart_failures: list[str] = []  # replacements that died before they were up (killed too)
    kills: list[str] = []
    with LocalCluster(plan, log_dir=log_dir) as cluster:
        with Client(cluster.coordinator) as client:  # warm every replica a little
            for seed in range(4):
                client.generate(f"warm-up {seed}", seed=seed, **REQUEST)  # type: ignore[arg-type]
        rss_start = {name: rss_mib(p.pid) for name, p in cluster.processes.items()}
        stop = threading.Event()
        restarts = 0

        def restart(stage: str, name: str) -> None:
            try:
                cluster.add(stage_process(stage, args.model, cluster.coordinator, name))
            except Exception as err:  # a replacement killed while it started, most likely
                restart_failures.append(f"{name}: {str(err).splitlines()[0]}"[:160])

        def chaos_loop() -> None:
            """Every `kill_every` seconds: SIGKILL a random stage replica and start a new one
            beside it (without waiting for it: the next kill may come before it is up)."""
            nonlocal restarts
            rng = random.Random(0)
            while not stop.wait(args.kill_every):
                name = rng.choice([n for n, p in list(cluster.processes.items()) if n != "coordinator"])
                cluster.processes[name].send_signal(signal.SIGKILL)
                cluster.processes[name].wait()
                kills.append(name)
                stage = next(s for s in STAGES if name.startswith(s))
                restarts += 1
                cluster.processes.pop(name)
                cluster.plan = [p for p in cluster.plan if p.name != name]
                threading.Thread(target=restart, args=(stage, f"{stage}-r{restarts}"), daemon=True).start()

        def worker(offset: int) -> None:
            with Client(cluster.coordinator) as own:
                for i in range(offset, args.requests, args.concurrency):
                    started = time.perf_counter()
                    try:
                        own.generate(f"a handwritten digit {i % 10}", seed=i, **REQUEST)  # type: ignore[arg-type]
                        latencies.append((time.perf_counter() - started) * 1e3)
                    except OmniError as err:
                        failures.append(f"{err.code.name}: {err.message[:160]}")

        chaos_thread = threading.Thread(target=chaos_loop, daemon=True) if chaos else None
        workers = [threading.Thread(target=worker, args=(w,)) for w in range(args.concurrency)]
        started = time.perf_counter()
        if chaos_thread:
            chaos_thread.start()
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join()
        stop.set()
        if chaos_thread:
            chaos_thread.join()
        wall_s = time.perf_counter() - started
        rss_end = {name: rss_mib(p.pid) for name, p in cluster.processes.items()}
    time.sleep(1.0)
    ordered = sorted(latencies)
    return {
        "chaos": chaos,
        "requests": args.requests,
        "lost": len(failures),
        "failures": sorted(set(failures))[:5],
        "kills": len(kills),
        "restarts_failed": len(restart_failures),
        "restart_failures": restart_failures[:3],
        "wall_s": round(wall_s, 1),
        "p50_ms": round(statistics.median(ordered), 1) if ordered else None,
        "p99_ms": round(ordered[int(0.99 * (len(ordered) - 1))], 1) if ordered else None,
        "rss_mib_after_warm_up": rss_start,
        "rss_mib_end": rss_end,
        "rss_growth_mib_max": max(
            (rss_end[n] - rss_start[n] for n in rss_end if n in rss_start), default=0.0
        ),
        "shm_segments_left": len(segments() - before),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, default=Path("models/qwen-image-digits"))
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--kill-every", type=float, default=5.0)
    parser.add_argument(
        "--replica-wait", type=float, default=120.0, help="the coordinator's --replica-wait, seconds"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for chaos in (False, True):
            print(json.dumps(run(args, chaos, Path(tmp) / ("chaos" if chaos else "calm"))), flush=True)


if __name__ == "__main__":
    main()
