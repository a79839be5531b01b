"""What both sides of benchmarks/glm_image_gpu.py share: each request's prompt, condition
image and seed, the medians, and the run's JSON lines."""

from __future__ import annotations

import io
import json
import statistics
from typing import Any

import numpy as np
from PIL import Image

PROMPT = "a shop sign that says 'open', in watercolor"


TASKS = ("t2i", "edit")


MAX_SEQUENCE_LENGTH = 2048  # the family's default (family.py), which the cluster applies


def prompt(number: int) -> str:
    """Each request's own prompt: no prompt or prefix cache answers for a timed request."""
    return f"{PROMPT}, study {number}"


def warm_up_number(size: int) -> int:
    """The prompt number and seed of a size's warm-up request, never timed: its prompt is as
    long as the timed ones' (1000 * size + run), so no timed request grows a static cache."""
    return 1000 * size + 999


def picture(number: int, size: int) -> bytes:
    """Request `number`'s condition image (edit): random pixels at the target size, as PNG.
    Each request has its own, so the cluster's condition-KV cache never answers for it."""
    pixels = (np.random.RandomState(number).rand(size, size, 3) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def p50(samples: list[float]) -> float:
    return round(statistics.median(samples), 1)


class Record:
    """The JSON lines of this run: printed as they come, kept for the summary."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def __call__(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        print(json.dumps(row), flush=True)


def failure(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"[:600]
