"""A burst: requests sent to a cluster all at once, each on its own client, connected (one
`ListModels` call) before the clock starts, as a serving client keeps its channel. Shared by
gpu_headline.py, multi_gpu.py and glm_image_gpu.py (run from benchmarks/ or with it on sys.path).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from omni_common.client import Client, GenerationResult


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
