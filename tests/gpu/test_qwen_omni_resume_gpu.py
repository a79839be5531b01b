"""Qwen2.5-Omni's talker and token2wav on a GPU (tiny fixture, float32): the talker loads there
(its decode is eager on every device) and, given up part way and restored from its checkpoint
on a fresh state, says the uninterrupted codes; token2wav restored from a window's checkpoint
(a CUDA generator's state) makes the uninterrupted mel. The thinker's chunks come from the CPU,
as a thinker replica on another device would send them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omni_common.models.base import StageState
from omni_common.models.qwen_omni.talker import Talker
from omni_common.models.qwen_omni.thinker import Thinker
from omni_common.models.qwen_omni.token2wav import Token2Wav
from omni_common.models.qwen_omni.vocoder import Vocoder
from tests.unit.models.qwen_omni.test_resume import _every, assert_same_chunks, resumed, run_until_checkpoint
from tests.unit.models.qwen_omni.test_runners import CPU, request, run_role

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def thinker(omni_model: Path) -> Thinker:
    return Thinker.load(omni_model, CPU, torch.float32)


@pytest.mark.parametrize("sampled", [0, 1])
def test_a_talker_on_the_gpu_resumes_with_the_uninterrupted_codes(
    thinker: Thinker, omni_model: Path, sampled: int
) -> None:
    talker = Talker.load(omni_model, CUDA, torch.float32)
    gen = request(seed=5, stream_audio=1, talker_do_sample=sampled)
    (rows,) = run_role(thinker, [gen], [[]])
    (want,) = run_role(talker, [gen], [rows])
    before, checkpoint = run_until_checkpoint(_every(talker, 5), gen, rows, 3)
    after = resumed(talker, gen, rows, checkpoint)
    got = before[: int(checkpoint.meta["chunks_sent"])] + after
    assert_same_chunks([_on_cpu(c) for c in got], [_on_cpu(c) for c in want])
    assert not talker.slots.active


def test_token2wav_on_the_gpu_resumes_with_the_uninterrupted_mel(thinker: Thinker, omni_model: Path) -> None:
    talker = Talker.load(omni_model, CPU, torch.float32)
    token2wav = Token2Wav.load(omni_model, CUDA)
    gen = request(seed=6, stream_audio=1)
    (rows,) = run_role(thinker, [gen], [[]])
    (codes,) = run_role(talker, [gen], [rows])
    (want,) = run_role(token2wav, [gen], [codes])
    before, checkpoint = run_until_checkpoint(token2wav, gen, codes, at=2)
    assert checkpoint.tensors["generator"].numel() == torch.Generator(CUDA).get_state().numel()
    got = before + resumed(token2wav, gen, codes, checkpoint)
    assert_same_chunks([_on_cpu(c) for c in got], [_on_cpu(c) for c in want])


def _on_cpu(chunk: StageState) -> StageState:
    return StageState({name: t.cpu() for name, t in chunk.tensors.items()}, chunk.meta)


@pytest.mark.parametrize(("compile", "tolerance"), [(False, 1e-5), (True, 1e-4)])
def test_token2wav_replayed_as_cuda_graphs_makes_the_eager_mel(
    thinker: Thinker, omni_model: Path, compile: bool, tolerance: float
) -> None:
    """Each RK4 interval replayed as a CUDA graph (one per batch and window length), its DiT
    forward compiled or not, three requests batched (a replay's rows padded to four), streamed:
    the eager forwards' chunks (the captured kernels; within float rounding should a product's
    kernel differ under capture, or the compiler's fused kernels add in another order)."""
    talker = Talker.load(omni_model, CPU, torch.float32)
    gens = [request(seed=seed, stream_audio=1) for seed in (6, 7, 8)]
    rows = [run_role(thinker, [gen], [[]])[0] for gen in gens]
    codes = [run_role(talker, [gen], [r])[0] for gen, r in zip(gens, rows, strict=True)]
    eager = run_role(Token2Wav.load(omni_model, CUDA), gens, codes)
    graphed_role = Token2Wav.load(omni_model, CUDA, cuda_graphs=True, compile=compile)
    while graphed_role.idle_work():
        pass
    graphed = run_role(graphed_role, gens, codes)
    assert graphed_role.graphs is not None and len(graphed_role.graphs) > 1
    worst = 0.0
    for got, want in zip(graphed, eager, strict=True):
        assert [c.meta for c in got] == [c.meta for c in want]
        for a, b in zip(got, want, strict=True):
            for name in b.tensors:
                if b.tensors[name].numel():  # the last chunk's lookahead is empty
                    worst = max(worst, float((a.tensors[name] - b.tensors[name]).abs().max()))
                torch.testing.assert_close(a.tensors[name], b.tensors[name], rtol=0, atol=tolerance)
    print(f"token2wav graphed (compile={compile}) vs eager: max difference {worst:.3g}")


def test_the_vocoder_replayed_as_cuda_graphs_makes_the_eager_samples(
    thinker: Thinker, omni_model: Path
) -> None:
    """Each BigVGAN window replayed as a CUDA graph (the common windows captured while idle, the
    rest at first use), two streamed requests batched: the eager samples within float rounding."""
    talker, token2wav = Talker.load(omni_model, CPU, torch.float32), Token2Wav.load(omni_model, CPU)
    gens = [request(seed=seed, stream_audio=1) for seed in (6, 7, 8)]
    mels = []
    for gen in gens:
        (rows,) = run_role(thinker, [gen], [[]])
        (codes,) = run_role(talker, [gen], [rows])
        mels.append(run_role(token2wav, [gen], [codes])[0])
    eager = run_role(Vocoder.load(omni_model, CUDA), gens, mels)
    graphed_role = Vocoder.load(omni_model, CUDA, cuda_graphs=True)
    while graphed_role.idle_work():
        pass
    graphed = run_role(graphed_role, gens, mels)
    assert graphed_role.graphs is not None and len(graphed_role.graphs) >= 2
    for got, want in zip(graphed, eager, strict=True):
        assert [c.meta for c in got] == [c.meta for c in want]
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a.tensors["audio"], b.tensors["audio"], rtol=0, atol=1e-5)
