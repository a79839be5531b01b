"""Qwen-Image's spread attention that projects by destination rank (ulysses.py), on two gloo
ranks of real processes: it is installed by the family's plan, and a spread forward through it
equals the one-process forward and the generic path's (diffusers' processor, its attention
function wrapped). The tiny fixture's 3 heads split 2 + 1 and 35 image tokens 18 + 17, so
uneven shares run both ways; two prompts of different lengths make the text mask real."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from diffusers.models.transformers.transformer_qwenimage import (
    QwenDoubleStreamAttnProcessor2_0,
    QwenImageTransformer2DModel,
)

from omni_common.execution.fp8 import float8_unsupported, to_float8
from omni_common.models.qwenimage.family import PARALLEL
from omni_common.models.qwenimage.ulysses import SpreadAttention, install

pytestmark = pytest.mark.slow

TOLERANCE = 1e-5  # fp32; the ranks sum attention's keys in another order
GRID = (1, 5, 7)  # frames, rows, columns of 2x2 patches: 35 image tokens


def _inputs(transformer: QwenImageTransformer2DModel) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    config = transformer.config
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0  # the second prompt is 4 tokens, padded to 6
    return {
        "hidden_states": torch.randn(2, GRID[0] * GRID[1] * GRID[2], config.in_channels, generator=generator),
        "encoder_hidden_states": torch.randn(2, 6, config.joint_attention_dim, generator=generator),
        "encoder_hidden_states_mask": mask,
        "timestep": torch.tensor([0.7, 0.3]),
        "img_shapes": [[GRID]] * 2,
        "return_dict": False,
    }


def _rank(rank: int, store: str, model: str, results: Any) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        results.put((rank, *_forwards(model)))
    except Exception as error:  # the parent reports it instead of waiting out its timeout
        results.put((rank, f"{type(error).__name__}: {error}"))
        raise
    finally:
        dist.destroy_process_group()


def _compiled_order(rank: int, store: str, model: str, results: Any) -> None:
    """The code inductor writes for one spread block: where the first all-to-all starts and
    is waited for, against the products between."""
    from torch._inductor.utils import run_and_get_code

    from omni_common.runtime.sequence_parallel import SequenceParallel

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        transformer = QwenImageTransformer2DModel.from_pretrained(Path(model) / "transformer").eval()
        spread = SequenceParallel(SimpleNamespace(transformer=transformer), PARALLEL, 2)
        transformer.transformer_blocks[0].compile(fullgraph=True)
        inputs = _inputs(transformer)
        with torch.no_grad(), spread.use(spread.full):
            _, code = run_and_get_code(lambda: transformer(**inputs))
        results.put((rank, "\n".join(code)))
    except Exception as error:  # the parent reports it instead of waiting out its timeout
        results.put((rank, f"FAILED {type(error).__name__}: {error}"))
        raise
    finally:
        dist.destroy_process_group()


def _forwards(model: str) -> tuple[Any, ...]:
    """Whether every block took the processor, and the forward alone, spread through it, and
    spread through the generic path."""
    from omni_common.runtime.sequence_parallel import SequenceParallel

    transformer = QwenImageTransformer2DModel.from_pretrained(Path(model) / "transformer").eval()
    spread = SequenceParallel(SimpleNamespace(transformer=transformer), PARALLEL, 2)
    installed = [type(block.attn.processor) is SpreadAttention for block in transformer.transformer_blocks]
    inputs = _inputs(transformer)
    with torch.no_grad():
        alone = transformer(**inputs)[0]
        with spread.use(spread.full):
            overlapped = transformer(**inputs)[0]
        for block in transformer.transformer_blocks:  # the generic path: diffusers' processor
            block.attn.processor = QwenDoubleStreamAttnProcessor2_0()
        with spread.use(spread.full):
            wrapped = transformer(**inputs)[0]
    # As numpy arrays: pickled whole, where a tensor would pass a descriptor the parent reads
    # only after this process may have exited.
    return installed, *(t.numpy() for t in (alone, overlapped, wrapped))


def _on_two_ranks(target: Any, tiny_model: Path, tmp_path: Path) -> list[tuple[Any, ...]]:
    """What `target` put on the queue in each of two gloo ranks, by rank; both exited cleanly."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ranks = [
        context.Process(target=target, args=(rank, str(tmp_path / "store"), str(tiny_model), results))
        for rank in range(2)
    ]
    for process in ranks:
        process.start()
    try:
        got = sorted((results.get(timeout=300) for _ in ranks), key=lambda item: item[0])
        for process in ranks:
            process.join(timeout=60)
    finally:  # a rank left waiting in a collective for a failed one
        for process in ranks:
            if process.is_alive():
                process.kill()
    failed = [item for item in got if isinstance(item[1], str) and item[1].startswith("FAILED")]
    assert not failed, failed
    assert [process.exitcode for process in ranks] == [0, 0]
    return got


def test_a_spread_forward_through_the_overlapped_attention_is_the_one_process_forward(
    tiny_model: Path, tmp_path: Path
) -> None:
    got = _on_two_ranks(_rank, tiny_model, tmp_path)
    for rank, installed, alone, overlapped, wrapped in got:
        assert installed == [True, True], rank
        assert np.abs(overlapped - alone).max() <= TOLERANCE, rank
        assert np.abs(overlapped - wrapped).max() <= TOLERANCE, rank
        assert np.abs(alone).max() > 0


def test_the_compiled_block_projects_its_own_heads_while_the_others_move(
    tiny_model: Path, tmp_path: Path
) -> None:
    """The overlap is an order in the compiled code: the first all-to-all starts, this rank's
    and the text's products run, then it is waited for (inductor put the wait right after the
    start until `overlap_collectives` sank it to its first use)."""
    for rank, code in _on_two_ranks(_compiled_order, tiny_model, tmp_path):
        calls = [line.strip() for line in code.splitlines() if not line.strip().startswith("#")]
        start = next(i for i, line in enumerate(calls) if "all_to_all_single.default(" in line)
        wait = next(i for i, line in enumerate(calls) if "wait_tensor.default(" in line)
        between = [
            line
            for line in calls[start:wait]
            if "extern_kernels.addmm(" in line or "extern_kernels.mm(" in line
        ]
        # This rank's heads (one product) and the text's q, k, v (three).
        assert len(between) >= 4, (rank, calls[start:wait])


@pytest.mark.skipif(bool(float8_unsupported(torch.device("cpu"))), reason="no FP8 products on this CPU")
def test_fp8_layers_keep_diffusers_processor_for_the_generic_path(tiny_model: Path) -> None:
    transformer = QwenImageTransformer2DModel.from_pretrained(tiny_model / "transformer")
    to_float8(transformer.transformer_blocks[1].attn.to_k)
    processors = [block.attn.processor for block in transformer.transformer_blocks]
    assert install(transformer, SimpleNamespace(group=None, token_shares=[])) is False
    assert [block.attn.processor for block in transformer.transformer_blocks] == processors
    assert not any(hasattr(block.attn, "ulysses_qkv") for block in transformer.transformer_blocks)
