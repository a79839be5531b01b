"""A dit-denoise replica over GPU worker processes (--devices cuda:...) on the tiny fixture:
its image against the same DiT on one GPU in the server's own process (skipped without CUDA).

One GPU runs the whole device path (a worker process, NCCL with one rank, the shared-memory
rings, the gather); two GPUs add the all-to-alls of sequence parallel and CFG parallel (forced:
the automatic mode keeps a lone tiny request on one rank). allclose, not bitwise: the
all-to-alls change the summation order; eager on both sides, then compiled and replayed as CUDA
graphs on both sides (a spread forward replays the graph its ranks captured together, the
all-to-alls inside).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from omni_common.client import Client
from tests.integration.conftest import InProcessCluster

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL workers)"),
]

EAGER = {"compile": "off", "cuda_graphs": "off", "threads": 1}
REQUEST = {"width": 64, "height": 64, "steps": 4, "return_tensor": True}
IMAGE_TOLERANCE = 1e-4
COMPILED = {"compile": "auto", "cuda_graphs": "auto"}
# Compiled blocks round differently where the ranks' kernels differ from the process's (the
# spread forward's shapes, each rank's own multi-kernel picks).
COMPILED_TOLERANCE = 1e-2


def image(dit: dict[str, object], model: Path, **params: object) -> np.ndarray:
    cluster = InProcessCluster(model, stage_options={"dit-denoise": {**EAGER, **dit}})
    cluster.start()
    try:
        with Client(cluster.coordinator) as client:
            tensor = client.generate_result("a red cat", **REQUEST, **params).tensor
    finally:
        cluster.stop()
    assert tensor is not None
    return tensor


@pytest.fixture(autouse=True)
def same_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    ("gpus", "mode"), [(1, "auto"), (2, "auto"), (2, "sequence-parallel")], ids=["1", "2", "2-spread"]
)
@pytest.mark.parametrize("cfg", [False, True], ids=["plain", "cfg"])
@pytest.mark.parametrize("execution", ["eager", "compiled"])
def test_gpu_workers_draw_the_one_gpu_image(
    tiny_model: Path, gpus: int, mode: str, cfg: bool, execution: str
) -> None:
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    params = {"seed": 7, **({"negative_prompt": "blurry", "guidance": 4.0} if cfg else {})}
    flags = {} if execution == "eager" else COMPILED
    one = image({"device": "cuda:0", **flags}, tiny_model, **params)
    devices = tuple(f"cuda:{i}" for i in range(gpus))
    spread = image({"devices": devices, "parallel_mode": mode, **flags}, tiny_model, **params)
    worst = float(np.abs(one - spread).max())
    print(f"max |{gpus} GPU workers ({mode}, {execution}) - one GPU in process| (cfg={cfg}): {worst:.3g}")
    assert worst <= (IMAGE_TOLERANCE if execution == "eager" else COMPILED_TOLERANCE)
