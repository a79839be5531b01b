"""The competitor's side of benchmarks/gpu_headline.py and multi_gpu.py (diffusers_best.py) on
the tiny fixture on the CPU: each compile mode loads, runs the pipeline, and draws diffusers'
eager image. aot_eager stands in for inductor (the same Dynamo graphs, fullgraph, no code
generation: minutes on this CPU); CUDA graphs themselves need a GPU."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def on_path() -> Iterator[None]:
    sys.path.insert(0, str(BENCHMARKS))  # the benchmarks import each other as scripts do
    yield
    sys.path.remove(str(BENCHMARKS))


def image(pipe: object, cfg: bool) -> torch.Tensor:
    guidance = {"negative_prompt": "blurry", "true_cfg_scale": 4.0} if cfg else {}
    generator = torch.Generator("cpu").manual_seed(3)
    out = pipe(
        "a red cat",
        width=32,
        height=32,
        num_inference_steps=2,
        generator=generator,
        output_type="pt",
        **guidance,
    )  # type: ignore[operator]
    return out.images


def test_every_compile_mode_draws_the_eager_image(tiny_model: Path) -> None:
    import diffusers_best

    expected: dict[bool, torch.Tensor] = {}
    for mode in ("eager", "regional", "whole"):
        pipe = diffusers_best.load(tiny_model, torch.device("cpu"), torch.float32, mode, backend="aot_eager")
        try:
            for cfg in (False, True):  # CFG: two calls a step, both outputs read after the second
                got = image(pipe, cfg)
                expected.setdefault(cfg, got)
                torch.testing.assert_close(got, expected[cfg], atol=1e-5, rtol=0, msg=f"{mode}, cfg={cfg}")
        finally:
            del pipe
            diffusers_best.release()
    assert diffusers_best.best({"regional": 3.0, "whole": 2.0}) == ("whole", 2.0)
    with pytest.raises(SystemExit, match="diffusers mode 'jit'"):
        diffusers_best.load(tiny_model, torch.device("cpu"), torch.float32, "jit")


def test_multi_gpu_times_the_competitor_per_size_cfg_and_mode(tiny_model: Path) -> None:
    import multi_gpu

    args = argparse.Namespace(
        cpu=True,
        dtype="float32",
        model=tiny_model,
        sizes=[32],
        steps=2,  # this scheduler (shift_terminal) needs two
        runs=1,
        diffusers_modes=["whole"],
        diffusers_backend="aot_eager",
    )
    timed = multi_gpu.measure_diffusers(args)
    assert set(timed) == {(32, False), (32, True)}
    assert all(set(modes) == {"whole"} and modes["whole"] > 0 for modes in timed.values())
