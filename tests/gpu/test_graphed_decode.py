"""The graphed AR decode (graphed_decode.py) on a GPU, with GLM-Image's prior on the tiny fixture
in float32: requests that join and leave between steps, across batch buckets, each pick the
tokens of the eager decode (the same draws from the same generator; attention by another kernel,
so a draw that falls within float rounding of a boundary could differ: none does here); a graph
is recorded once per bucket, never per request; a request released mid-decode (cancelled) frees
its slot for the next one, and the others carry on unchanged."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from omni_common.models.base import GenerationRequest, StageState
from omni_common.models.glm_image.fixture import build_tiny_fixture
from omni_common.models.glm_image.prior import GlmImagePrior, PriorState

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)"),
]

DEVICE = torch.device("cuda", 0)
PROMPTS = ["a red cafe", "a blue boat with a long sign", "kite", "a tree", "gold", "green kite over a sea"]


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_fixture(tmp_path_factory.mktemp("glm") / "model")


def request(i: int) -> GenerationRequest:
    return GenerationRequest(prompt=PROMPTS[i % len(PROMPTS)], width=64, height=64, seed=i)


def run(
    prior: GlmImagePrior, joins: Sequence[tuple[int, int]], cancel: dict[int, int]
) -> dict[int, list[int]]:
    """Requests i joining at step s ((i, s) in `joins`), `cancel` {i: step} released then; each
    request's tokens (of those not cancelled)."""
    states: dict[int, PriorState] = {}
    step = 0
    while step < 2 or any(not prior.is_done(s) for s in states.values()):
        for i, at in joins:
            if at == step:
                states[i] = prior.prepare(request(i), StageState({}))
        for i, at in cancel.items():
            if at == step and i in states:
                prior.release(states.pop(i))
        prior.step([s for s in states.values() if not prior.is_done(s)])
        step += 1
    for state in states.values():
        prior.release(state)
    return {i: state.sampled.tolist() for i, state in states.items()}


def test_joins_leaves_and_cancel_across_buckets_pick_the_eager_tokens_and_record_once_per_bucket(
    glm_dir: Path,
) -> None:
    eager = GlmImagePrior.load(glm_dir, DEVICE, torch.float32, max_slots=8, max_tokens=1024, decode="eager")
    graphed = GlmImagePrior.load(
        glm_dir, DEVICE, torch.float32, max_slots=8, max_tokens=1024, decode="graphs"
    )
    assert graphed.graphed is not None
    # 1 row, then 2 (bucket 2), then 5 (bucket 8): joins mid-decode; request 1 leaves early.
    joins = [(0, 0), (1, 3), (2, 10), (3, 10), (4, 11), (5, 40)]
    cancel = {1: 30}
    expected = run(eager, joins, cancel)
    found = run(graphed, joins, cancel)
    assert found == expected
    recorded = graphed.graphed.captures
    assert recorded == len(graphed.graphed.graphs) <= 4  # buckets 1, 2, 4, 8 at most
    # The same traffic again records nothing: graphs are per bucket, never per request.
    assert run(graphed, joins, cancel) == expected
    assert graphed.graphed.captures == recorded
    assert not graphed.slots.active  # every slot was released


def test_idle_work_records_every_bucket_ahead_and_requests_then_record_none(glm_dir: Path) -> None:
    """The prior expects its one sampling setting from load: idle time records its step at each
    bucket (smallest first), after which traffic across buckets replays and picks the eager
    tokens."""
    graphed = GlmImagePrior.load(
        glm_dir, DEVICE, torch.float32, max_slots=8, max_tokens=1024, decode="graphs"
    )
    assert graphed.graphed is not None and graphed.graphed.captures == 0
    assert graphed.idle_work_left() == 4  # buckets 1, 2, 4, 8
    while graphed.idle_work():
        pass
    assert graphed.idle_work_left() == 0 and graphed.graphed.captures == 4
    assert sorted(size for size, _ in graphed.graphed.graphs) == [1, 2, 4, 8]
    eager = GlmImagePrior.load(glm_dir, DEVICE, torch.float32, max_slots=8, max_tokens=1024, decode="eager")
    joins = [(0, 0), (1, 3), (2, 10), (3, 10), (4, 11), (5, 40)]
    assert run(graphed, joins, {1: 30}) == run(eager, joins, {1: 30})
    assert graphed.graphed.captures == 4  # no request recorded a step
