"""The graphed decode's step (graphed_decode.py), run unrecorded on the CPU (padded attention,
float32, tiny GLM-Image): requests that join mid-decode and leave early pick exactly the eager
decode's tokens, read a step late; traced as torch.compile traces it, the step writes its KV in
place. The recorded form is pinned on a GPU by tests/gpu/test_graphed_decode.py."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from torch._dynamo.backends.common import aot_autograd

from omni_common.models.base import GenerationRequest, StageState
from omni_common.models.glm_image.prior import GlmImagePrior, PriorState
from omni_common.models.graphed_attention import FLEX_MIN_HEAD_DIM, attention_for

CPU = torch.device("cpu")
PROMPTS = ["a red cafe", "a blue boat with a long sign", "kite"]


def run(prior: GlmImagePrior) -> dict[int, list[int]]:
    """Request 0 from step 0, 1 from step 3 (released at step 40), 2 from step 5."""
    states: dict[int, PriorState] = {}
    step = 0
    while step < 6 or any(not prior.is_done(s) for s in states.values()):
        for i, at in ((0, 0), (1, 3), (2, 5)):
            if at == step:
                request = GenerationRequest(prompt=PROMPTS[i], width=64, height=64, seed=i)
                states[i] = prior.prepare(request, StageState({}))
        if step == 40:
            prior.release(states.pop(1))
        prior.step([s for s in states.values() if not prior.is_done(s)])
        step += 1
    for state in states.values():
        prior.release(state)
    return {i: state.sampled.tolist() for i, state in states.items()}


def test_the_unrecorded_graphed_step_picks_the_eager_tokens(glm_model: Path) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        eager = GlmImagePrior.load(glm_model, CPU, torch.float32, max_slots=4, decode="eager")
        graphed = GlmImagePrior.load(
            glm_model, CPU, torch.float32, max_slots=4, max_tokens=1024, decode="graphs"
        )
        assert run(graphed) == run(eager)
    finally:
        torch.set_num_threads(threads)


def test_heads_too_small_for_flex_attention_on_a_gpu_take_the_padded_attention() -> None:
    cuda = torch.device("cuda", 0)
    assert attention_for("flex", 8, cuda) == "padded"  # the tiny fixtures' heads
    assert attention_for("flex", FLEX_MIN_HEAD_DIM, cuda) == "flex"
    assert attention_for("flex", 8, CPU) == "flex"  # the CPU runs it unrecorded, as a reference
    assert attention_for("padded", 128, cuda) == "padded"


def test_the_prior_expects_its_one_sampling_setting_and_records_nothing_off_cuda(glm_model: Path) -> None:
    graphed = GlmImagePrior.load(glm_model, CPU, torch.float32, max_slots=4, max_tokens=1024, decode="graphs")
    assert graphed.graphed is not None and graphed.graphed.bucket_sizes() == [1, 2, 4]
    request = GenerationRequest(prompt=PROMPTS[0], width=64, height=64, seed=3)
    state = graphed.prepare(request, StageState({}))
    assert list(graphed.warm_samplings) == [state.sampling.graph_key]  # a request's is the load's
    # Off CUDA the step runs unrecorded: idle time has nothing to record.
    assert graphed.idle_work_left() == 0 and not graphed.idle_work()
    graphed.release(state)


def test_the_traced_step_writes_its_kv_into_the_slot_buffers_in_place(glm_model: Path) -> None:
    """A step of fewer rows than slots (bucket 1 of 4) traced as torch.compile traces it, after
    functionalization: each layer's key and value are one index_put into the slot buffers, and
    nothing scatters a view back (written through a view of the buffers' first rows, the step
    copied those rows' whole KV twice a layer: 3.2x a talker step of 8 rows of 64 slots)."""
    prior = GlmImagePrior.load(glm_model, CPU, torch.float32, max_slots=4, max_tokens=1024, decode="graphs")
    graphed = prior.graphed
    assert graphed is not None
    ops: Counter[str] = Counter()

    def record(module: torch.fx.GraphModule, inputs: object) -> torch.fx.GraphModule:
        ops.update(str(node.target) for node in module.graph.nodes if node.op == "call_function")
        return module  # run as traced

    torch._dynamo.reset()
    traced = torch.compile(graphed._forward, dynamic=False, backend=aot_autograd(fw_compiler=record))
    with torch.no_grad():
        traced(1)
    layers = len(graphed.slots.keys)
    assert ops["aten.index_put.default"] == 2 * layers
    assert not [op for op in ops if "scatter" in op]
