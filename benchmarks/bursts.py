"""A burst: requests sent to a cluster all at once, each on its own client, connected (one
`ListModels` call) before the clock starts, as a serving client keeps its channel; and a stage's
/metrics read, to wait for its idle work (graphs recorded ahead) before the clock starts. Shared
by gpu_headline.py, multi_gpu.py, glm_image_gpu.py and speech.py (run from benchmarks/ or with
it on sys.path).
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from omni_common.client import Client, GenerationResult
from omni_common.cluster import LOOPBACK, LocalProcess, free_port


@dataclass(frozen=True)
class Burst:
    """What a burst took: its wall time, each result, and when each arrived after the start."""

    wall_s: float
    results: list[GenerationResult]
    done_ms: list[float]

    @property
    def img_per_s(self) -> float:
        return round(len(self.results) / self.wall_s, 3)


def burst(coordinator: str, requests: Sequence[tuple[str, dict[str, Any]]]) -> Burst:
    """Send every (prompt, generate_result keywords) of `requests` at once and wait for all;
    RuntimeError when any failed (a failed request must not look fast)."""
    clients = [Client(coordinator) for _ in requests]
    try:
        for client in clients:
            client.list_models()
        with ThreadPoolExecutor(len(requests)) as pool:
            started = time.perf_counter()

            def one(client: Client, prompt: str, options: dict[str, Any]) -> tuple[GenerationResult, float]:
                result = client.generate_result(prompt, **options)
                return result, (time.perf_counter() - started) * 1e3

            jobs = [pool.submit(one, c, p, o) for c, (p, o) in zip(clients, requests, strict=True)]
            outcomes, errors = [], []
            for job in jobs:
                try:
                    outcomes.append(job.result())
                except Exception as err:  # reported below, after every request has ended
                    errors.append(err)
            wall_s = time.perf_counter() - started
    finally:
        for client in clients:
            client.close()
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(requests)} requests at once failed: {errors[0]}")
    return Burst(wall_s, [r for r, _ in outcomes], [ms for _, ms in outcomes])


def with_metrics(plan: list[LocalProcess], name: str) -> tuple[list[LocalProcess], str]:
    """`plan` with process `name` serving its metrics on a free port; their URL."""
    port = free_port()
    index = next(i for i, proc in enumerate(plan) if proc.name == name)
    proc = plan[index]
    plan[index] = replace(proc, environment={**proc.environment, "OMNISTAGE_METRICS_PORT": str(port)})
    return plan, f"http://{LOOPBACK}:{port}/metrics"


def metric_total(url: str, name: str, label: str = "") -> float:
    """The sum of metric `name`'s samples (those whose labels contain `label`) at `url`."""
    with urllib.request.urlopen(url, timeout=10) as response:  # (our own loopback URL)
        lines = response.read().decode().splitlines()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{") and label in line
    )


def wait_idle_work(url: str, limit_s: float = 1800.0) -> float:
    """Wait until the stage at `url` has done its idle work (graphs recorded ahead: the DiT's
    common prompt lengths, an AR's batch buckets), so no timed request waits for one; the
    seconds waited."""
    started = time.perf_counter()
    while metric_total(url, "omnistage_idle_work_left") > 0:
        if time.perf_counter() - started > limit_s:
            raise RuntimeError(f"the idle work at {url} is not done after {limit_s:.0f} s")
        time.sleep(0.5)
    return round(time.perf_counter() - started, 1)
