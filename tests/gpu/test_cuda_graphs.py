"""The Qwen-Image DiT replayed as CUDA graphs on the tiny fixture (skipped without CUDA).

A replay must give what the eager forward gives on the same padded inputs, follow new input
values through its static buffers, take a new graph only for a new bucket, and survive the
weights moving (sleep/wake) by capturing again. fp32, so differences are float rounding
(~1e-7 here; see tests/unit/models/qwenimage/test_graphs.py for the padding's own tolerance).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omni_common.execution import compile_cache
from omni_common.models.base import DenoiserOptions, GenerationRequest, StageState
from omni_common.models.qwenimage.denoise import QwenImageDenoiser
from omni_common.models.qwenimage.encode import QwenImageEncoder
from omni_common.models.qwenimage.execution import transformer_forward
from omni_common.models.qwenimage.family import MODULES
from omni_common.models.qwenimage.warmup import REAL_TEXT_TOKENS
from omni_common.runtime.memory import WeightSleeper, discover_modules

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)"),
]

DEVICE = torch.device("cuda", 0)
ATOL = 1e-5


@pytest.fixture
def denoiser(tiny_model: Path):
    return QwenImageDenoiser.load(tiny_model, DEVICE, torch.float32, DenoiserOptions(cuda_graphs=True))


def forward_inputs(denoiser, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]:
    config = denoiser.transformer.config
    generator = torch.Generator(DEVICE).manual_seed(seed)
    img_shape = denoiser.img_shape(64, 64)
    latents = torch.randn(
        (rows, img_shape[1] * img_shape[2], config["in_channels"]), generator=generator, device=DEVICE
    )
    timestep = torch.rand((rows,), generator=generator, device=DEVICE) * 1000
    embeds = torch.randn((rows, 9, config["joint_attention_dim"]), generator=generator, device=DEVICE)
    return latents, timestep, embeds, [[img_shape]] * rows


def eager(denoiser, latents, timestep, embeds, img_shapes) -> torch.Tensor:
    inputs = {"latents": latents, "timestep": timestep, "embeds": embeds}
    with torch.inference_mode():
        return transformer_forward(denoiser.transformer, inputs, img_shapes)


def graphed(denoiser, latents, timestep, embeds, img_shapes) -> torch.Tensor:
    with torch.inference_mode():
        return denoiser._forward(latents, timestep, embeds, None, img_shapes)


def test_a_replay_equals_the_eager_forward_and_follows_new_inputs(denoiser) -> None:
    for seed in (0, 1):  # the second call replays the graph the first one captured
        args = forward_inputs(denoiser, 3, seed)
        torch.testing.assert_close(graphed(denoiser, *args), eager(denoiser, *args), atol=ATOL, rtol=0)
    assert len(denoiser.graphed.cache) == 1  # 3 rows -> the bucket of 4, one graph


def test_each_bucket_gets_its_own_graph(denoiser) -> None:
    for rows in (1, 2, 3, 4, 5):
        args = forward_inputs(denoiser, rows, rows)
        torch.testing.assert_close(graphed(denoiser, *args), eager(denoiser, *args), atol=ATOL, rtol=0)
    assert len(denoiser.graphed.cache) == 4  # buckets 1, 2, 4, 8


def test_graphs_are_captured_again_after_the_weights_moved(denoiser) -> None:
    args = forward_inputs(denoiser, 1, 0)
    before = graphed(denoiser, *args)
    sleeper = WeightSleeper(discover_modules(denoiser, MODULES, "dit"), DEVICE)
    sleeper.sleep(1)
    denoiser.forget_cuda_graphs()  # what the worker does after a sleep
    assert len(denoiser.graphed.cache) == 0
    sleeper.wake()  # the weights come back at new addresses
    assert torch.equal(graphed(denoiser, *args), before)


def test_sizes_asked_for_are_captured_at_load(tiny_model: Path) -> None:
    options = DenoiserOptions(cuda_graphs=True, capture_sizes=((64, 64),), max_batch=2)
    denoiser = QwenImageDenoiser.load(tiny_model, DEVICE, torch.float32, options)
    # One request with a prompt of REAL_TEXT_TOKENS[0] tokens; two of different lengths
    # padded to 32 and to 64 tokens.
    assert len(denoiser.graphed.cache) == 3
    latents, timestep, embeds, img_shapes = forward_inputs(denoiser, 1, 0)
    embeds = torch.cat([embeds, embeds], dim=1)[:, : REAL_TEXT_TOKENS[0]]
    graphed(denoiser, latents, timestep, embeds, img_shapes)
    latents, timestep, embeds, img_shapes = forward_inputs(denoiser, 2, 0)
    embeds = torch.cat([embeds] * 4, dim=1)[:, :30]  # padded to 32 tokens
    mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=DEVICE)
    mask[1, 5:] = 0  # the second prompt is shorter
    with torch.inference_mode():
        denoiser._forward(latents, timestep, embeds, mask, img_shapes)
    assert len(denoiser.graphed.cache) == 3  # both served by graphs captured ahead


def test_a_warm_start_captures_nothing_at_load_and_graphs_what_requests_bring(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whether each bucket's replay pays is kept in the compile cache: a restarted stage
    captures no made-up shapes at load, and a request's shapes are captured on first use."""
    monkeypatch.setattr(compile_cache, "_directory", tmp_path)
    options = DenoiserOptions(cuda_graphs=True, capture_sizes=((64, 64),), max_batch=2)
    assert len(QwenImageDenoiser.load(tiny_model, DEVICE, torch.float32, options).graphed.cache) == 3
    restarted = QwenImageDenoiser.load(tiny_model, DEVICE, torch.float32, options)
    assert len(restarted.graphed.cache) == 0
    args = forward_inputs(restarted, 1, 3)
    torch.testing.assert_close(graphed(restarted, *args), eager(restarted, *args), atol=ATOL, rtol=0)
    assert len(restarted.graphed.cache) == 1
    torch.testing.assert_close(graphed(restarted, *args), eager(restarted, *args), atol=ATOL, rtol=0)


def test_a_lone_prompt_replays_a_graph_of_its_own_length_without_a_mask(denoiser) -> None:
    """Unmasked prompts of one length keep attention's fastest kernel: their graph is of that
    exact length, no mask; a new length is a new graph, whose keeping was decided once."""
    for length in (9, 13):
        latents, timestep, embeds, img_shapes = forward_inputs(denoiser, 1, length)
        embeds = torch.cat([embeds, embeds], dim=1)[:, :length]
        args = (latents, timestep, embeds, img_shapes)
        torch.testing.assert_close(graphed(denoiser, *args), eager(denoiser, *args), atol=ATOL, rtol=0)
    captured = denoiser.graphed.cache._graphs
    assert [key[-1] for key in captured] == [9, 13]
    assert all("mask" not in graph.inputs for graph in captured.values())


def test_a_whole_denoise_with_graphs_matches_eager(tiny_model: Path, denoiser) -> None:
    encoder = QwenImageEncoder.load(tiny_model, DEVICE, torch.float32)
    plain = QwenImageDenoiser.load(tiny_model, DEVICE, torch.float32)
    requests = [
        GenerationRequest(prompt=p, width=64, height=64, num_inference_steps=6, seed=i, true_cfg_scale=1.0)
        for i, p in enumerate(["a cat", "a red cat sitting on a blue mat"])
    ]
    embeds = encoder.encode(requests)

    def run(runner) -> list[StageState]:
        states = [runner.prepare(r, e) for r, e in zip(requests, embeds, strict=True)]
        while not runner.is_done(states[0]):
            runner.step(states)
        return [runner.finish(s) for s in states]

    for got, expected in zip(run(denoiser), run(plain), strict=True):
        torch.testing.assert_close(got.tensors["latents"], expected.tensors["latents"], atol=ATOL, rtol=0)
    assert len(denoiser.graphed.cache) >= 1


@pytest.mark.parametrize("negative", ["", "blurry, low quality, watermark"], ids=["alone", "cfg-masked"])
def test_a_step_cached_request_replays_its_later_blocks_and_matches_eager(
    tiny_model: Path, negative: str
) -> None:
    """The GPU default (compiled blocks, graphs, packed modulation rows) with the step cache:
    block 0 runs apart, the later blocks replay as a graph of their own (with true CFG, the
    two prompts' lengths differ: padded and masked), and the latents are the eager run's
    (the same steps reused)."""
    encoder = QwenImageEncoder.load(tiny_model, DEVICE, torch.float32)
    plain = QwenImageDenoiser.load(tiny_model, DEVICE, torch.float32)
    options = DenoiserOptions(cuda_graphs=True, compile=True)
    compiled = QwenImageDenoiser.load(tiny_model, DEVICE, torch.float32, options)
    request = GenerationRequest(
        prompt="a cat",
        negative_prompt=negative,
        true_cfg_scale=4.0,
        width=64,
        height=64,
        num_inference_steps=6,
        seed=3,
        options=(("step_cache", "1.0"),),
    )
    (embeds,) = encoder.encode([request])

    def run(runner) -> tuple[StageState, int]:
        state = runner.prepare(request, embeds)
        while not runner.is_done(state):
            runner.step([state])
        reused = state.step_cache.cached_steps
        return runner.finish(state), reused

    (got, got_reused), (expected, expected_reused) = run(compiled), run(plain)
    torch.testing.assert_close(got.tensors["latents"], expected.tensors["latents"], atol=1e-4, rtol=0)
    assert got_reused == expected_reused > 0
    graphs = [
        (key, graph)
        for key, graph in compiled.graphed.cache._graphs.items()
        if key[0] == "step-cache-later-blocks"
    ]
    assert graphs
    assert all(("mask" in graph.inputs) == bool(negative) for _, graph in graphs)


def test_compiled_blocks_replayed_as_graphs_match_eager(tiny_model: Path) -> None:
    """The GPU default (--compile auto, --cuda-graphs auto): compiled blocks inside a graph."""
    options = DenoiserOptions(cuda_graphs=True, compile=True)
    compiled = QwenImageDenoiser.load(tiny_model, DEVICE, torch.float32, options)
    for rows in (1, 3):
        args = forward_inputs(compiled, rows, rows)
        torch.testing.assert_close(graphed(compiled, *args), eager(compiled, *args), atol=1e-4, rtol=0)
    assert len(compiled.graphed.cache) == 2


def test_a_capture_goes_through_while_another_thread_moves_tensors(denoiser) -> None:
    """The stage's event loop thread opens and exports tensors while the compute thread may
    be capturing; the capture must neither fail nor break that thread's work. (That thread
    draws no random numbers on the GPU: PyTorch refuses that during a capture.)"""
    import threading

    stop, errors, moved = threading.Event(), [], [0]

    def transport_work() -> None:
        stream = torch.cuda.Stream(DEVICE)
        try:
            while not stop.is_set():
                with torch.cuda.stream(stream):
                    tensor = torch.full((1 << 16,), 2.0, device=DEVICE).cpu()
                event = torch.cuda.Event()
                event.record(stream)
                event.synchronize()
                moved[0] += int(tensor.numel() > 0)
        except Exception as err:
            errors.append(err)

    worker = threading.Thread(target=transport_work)
    worker.start()
    try:
        args = forward_inputs(denoiser, 2, 0)
        got = graphed(denoiser, *args)
    finally:
        stop.set()
        worker.join(30)
    assert not errors, errors
    assert moved[0] > 0 and len(denoiser.graphed.cache) == 1
    torch.testing.assert_close(got, eager(denoiser, *args), atol=ATOL, rtol=0)


def test_after_the_warm_up_real_prompt_lengths_compile_nothing_new(tiny_model: Path) -> None:
    """A bucket without a graph runs the compiled forward on the real shapes; the warm-up
    compiled those for dynamic prompt lengths and batches, so a new length recompiles nothing."""
    from torch._dynamo.utils import counters

    options = DenoiserOptions(compile=True, capture_sizes=((64, 64),), max_batch=4)
    compiled = QwenImageDenoiser.load(tiny_model, DEVICE, torch.float32, options)
    graphs_before = counters["stats"]["unique_graphs"]
    for rows, length_seed in ((1, 5), (3, 6)):
        latents, timestep, embeds, img_shapes = forward_inputs(compiled, rows, length_seed)
        embeds = embeds[:, : 4 + length_seed]  # prompt lengths the warm-up never saw
        got = graphed(compiled, latents, timestep, embeds, img_shapes)
        torch.testing.assert_close(
            got, eager(compiled, latents, timestep, embeds, img_shapes), atol=1e-4, rtol=0
        )
    assert counters["stats"]["unique_graphs"] == graphs_before


def test_a_restarted_cache_follows_the_keep_decisions_of_the_first(tmp_path: Path) -> None:
    from omni_common.execution.compile_cache import KeepDecisions
    from omni_common.execution.cuda_graphs import KEEP_IF_FASTER, CudaGraphCache

    def fn(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return inputs["x"] * 2 + 1

    x = torch.arange(8.0, device=DEVICE)
    CudaGraphCache(DEVICE, decisions=KeepDecisions(tmp_path / "keep.json")).run("k", {"x": x}, fn)
    speedup = KeepDecisions(tmp_path / "keep.json").get("k")
    assert speedup is not None
    kept = speedup * KEEP_IF_FASTER >= 1
    restarted = CudaGraphCache(DEVICE, decisions=KeepDecisions(tmp_path / "keep.json"))
    out = restarted.run("k", {"x": x}, fn)
    assert (out is not None) == kept and len(restarted) == int(kept)
    if out is not None:
        assert torch.equal(out, fn({"x": x}))


def test_a_graph_not_kept_leaves_later_captures_working(monkeypatch) -> None:
    """The first graph timed and dropped (its replay did not pay) must not take the memory pool
    with it: later keys still capture (on an H200, every later capture failed an allocator
    assertion and ran eagerly)."""
    from omni_common.execution import cuda_graphs

    def fn(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return inputs["x"] * 2 + 1

    x = torch.arange(1 << 20, dtype=torch.float32, device=DEVICE)
    cache = cuda_graphs.CudaGraphCache(DEVICE)
    monkeypatch.setattr(cuda_graphs, "_pays", lambda speedup: False)
    assert torch.equal(cache.run("dropped", {"x": x}, fn), fn({"x": x}))
    assert len(cache) == 0
    monkeypatch.setattr(cuda_graphs, "_pays", lambda speedup: True)
    for key in ("kept", "also kept"):
        assert torch.equal(cache.run(key, {"x": x}, fn), fn({"x": x}))
    assert len(cache) == 2
    assert torch.equal(cache.run("kept", {"x": x + 1}, fn), fn({"x": x + 1}))  # a replay
    cache.clear()
    assert torch.equal(cache.run("after clear", {"x": x}, fn), fn({"x": x}))
    assert len(cache) == 1


def test_padded_rows_run_as_they_are_where_the_replay_cannot_pay_for_them(denoiser) -> None:
    graphed(denoiser, *forward_inputs(denoiser, 4, 1))  # captures the bucket of 4
    (captured,) = denoiser.graphed.cache._graphs.values()
    captured.speedup = 1.2  # as measured for compute-bound shapes (1024x1024 on an H100)
    latents, timestep, embeds, img_shapes = forward_inputs(denoiser, 3, 2)
    with torch.inference_mode():
        assert denoiser.graphed(latents, timestep, embeds, None, img_shapes) is None
    captured.speedup = 3.0  # launch-bound: a replay of 4 beats 3 run eagerly
    with torch.inference_mode():
        assert denoiser.graphed(latents, timestep, embeds, None, img_shapes) is not None


def test_graphs_of_common_prompt_lengths_are_captured_while_idle(tiny_model: Path) -> None:
    """After the warm-up the stage captures one graph per common prompt length while idle;
    a request of such a length then replays from its first step, capturing nothing."""
    from omni_common.models.qwenimage.warmup import IDLE_CAPTURE_TOKENS

    options = DenoiserOptions(cuda_graphs=True, capture_sizes=((64, 64),), max_batch=1)
    denoiser = QwenImageDenoiser.load(tiny_model, DEVICE, torch.float32, options)
    assert denoiser.idle_work_left() == len(IDLE_CAPTURE_TOKENS)
    units = 0
    while denoiser.idle_work():
        units += 1
    assert denoiser.idle_work_left() == 0
    assert units == len(IDLE_CAPTURE_TOKENS) - 1  # REAL_TEXT_TOKENS[0]'s came with the warm-up
    captured = len(denoiser.graphed.cache)
    length = 29
    latents, timestep, embeds, img_shapes = forward_inputs(denoiser, 1, length)
    embeds = torch.cat([embeds] * 4, dim=1)[:, :length]
    args = (latents, timestep, embeds, img_shapes)
    torch.testing.assert_close(graphed(denoiser, *args), eager(denoiser, *args), atol=ATOL, rtol=0)
    assert len(denoiser.graphed.cache) == captured
    denoiser.forget_cuda_graphs()  # a sleep: nothing more is captured while idle
    assert not denoiser.idle_work() and denoiser.idle_work_left() == 0


def test_a_warm_start_serves_one_request_first_and_loads_the_rest_while_idle(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a warm compile cache the stage serves once one request at each size runs
    compiled (warmup.py); its idle work loads the rest of the warm-up before it captures
    graphs of common prompt lengths."""
    from omni_common.models.qwenimage import execution

    monkeypatch.setattr(execution, "compile_cache_is_warm", lambda: True)
    options = DenoiserOptions(
        compile=True, cuda_graphs=True, capture_sizes=((64, 64), (32, 32)), max_batch=2, defer_warm_up=True
    )
    deferred = QwenImageDenoiser.load(tiny_model, DEVICE, torch.float32, options)
    assert deferred.warm_up is not None
    left = deferred.warm_up.left
    assert 0 < left < deferred.warm_up.total
    captures = deferred.graphed.idle_captures_left
    assert deferred.idle_work_left() == left + captures
    args = forward_inputs(deferred, 1, 0)  # served before the rest has loaded
    torch.testing.assert_close(graphed(deferred, *args), eager(deferred, *args), atol=ATOL, rtol=0)
    for _ in range(left):
        assert deferred.idle_work()
    assert deferred.warm_up.left == 0 and deferred.graphed.idle_captures_left == captures
    monkeypatch.setattr(execution, "compile_cache_is_warm", lambda: False)
    cold = QwenImageDenoiser.load(tiny_model, DEVICE, torch.float32, options)
    assert cold.warm_up is not None and cold.warm_up.left == 0  # a cold start compiles it all first
