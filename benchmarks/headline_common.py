"""What both sides of benchmarks/gpu_headline.py share: the prompts, one side's measurements,
the medians and the JSON lines."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field

import numpy as np

PROMPT = "a watercolor lighthouse at dusk"


def prompt(number: int) -> str:
    """Each timed request's own prompt: the encoder's prompt cache never answers for it, so
    both sides encode every prompt (the first one is the same on both: its images compare)."""
    return PROMPT if number == 0 else f"{PROMPT}, study {number}"


def p50(samples: list[float]) -> float:
    return round(statistics.median(samples), 1)


def emit(row: dict[str, object]) -> None:
    print(json.dumps(row), flush=True)


@dataclass
class Side:
    """One side's measurements: p50 latency and first image per size, throughput."""

    p50_ms: dict[int, float] = field(default_factory=dict)
    images: dict[int, np.ndarray] = field(default_factory=dict)
    img_per_s: float = 0.0
    start_s: float = 0.0
    warm_start_s: float = 0.0
    step: dict[int, dict[str, float]] = field(default_factory=dict)


NEGATIVE = "blurry, low quality"  # the negative prompt of both sides with --guidance above 1
