"""Fused sibling projections (fused_projections.py) on a small Qwen2 decoder: the model's
outputs stay those of the separate projections (to float32 rounding), its weights become views
of one joint buffer (no second copy), and a projection called on another input computes alone."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from omni_common.models.fused_projections import FusedProjection, fuse_projections


def small_model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return Qwen2ForCausalLM(config).eval()


def test_fused_projections_keep_the_outputs_and_share_one_buffer() -> None:
    model = small_model()
    ids = torch.arange(10).view(1, -1)
    with torch.no_grad():
        before = model(ids).logits
        assert fuse_projections(model.model) == 4  # attention and MLP of 2 layers
        after = model(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    attention = model.model.layers[0].self_attn
    q, k = attention.q_proj, attention.k_proj
    assert isinstance(q, FusedProjection) and isinstance(k, FusedProjection)
    assert q.weight.untyped_storage().data_ptr() == k.weight.untyped_storage().data_ptr()


def test_a_projection_called_on_another_input_computes_alone() -> None:
    model = small_model()
    reference = model.model.layers[0].self_attn.v_proj
    x, other = torch.randn(2, 32), torch.randn(2, 32)
    with torch.no_grad():
        expected = reference(other)
        fuse_projections(model.model)
        attention = model.model.layers[0].self_attn
        attention.q_proj(x)  # the joint product of x
        torch.testing.assert_close(attention.v_proj(other), expected)


def test_the_groups_last_projection_lets_the_joint_product_go() -> None:
    """What the joint keeps between its projections' calls is released by the last one: a long
    prefill's products would otherwise stay until the next forward."""
    model = small_model()
    with torch.no_grad():
        fuse_projections(model.model)
        model(torch.arange(10).view(1, -1))
    joints = {id(m.joint): m.joint for m in model.modules() if isinstance(m, FusedProjection)}
    assert len(joints) == 4
    assert all(joint.input is None and joint.parts == () for joint in joints.values())
