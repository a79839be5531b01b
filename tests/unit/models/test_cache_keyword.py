"""kv_slots.cache_keyword: the name a model's forward takes its KV cache under, read from the
installed transformers release's signature (`cache` from 5.24, `past_key_values` before)."""

from __future__ import annotations

import inspect

import torch
from transformers import Qwen2_5OmniTalkerForConditionalGeneration

from omni_common.models.kv_slots import cache_keyword


class Renamed(torch.nn.Module):
    def forward(self, input_ids: torch.Tensor, cache: object = None) -> torch.Tensor:
        return input_ids


class Older(torch.nn.Module):
    def forward(self, input_ids: torch.Tensor, past_key_values: object = None) -> torch.Tensor:
        return input_ids


def test_the_name_the_forward_declares_is_the_one_given() -> None:
    assert cache_keyword(Renamed()) == "cache"
    assert cache_keyword(Older()) == "past_key_values"


def test_a_real_models_decorated_forward_is_read_through_its_wrapper() -> None:
    # transformers wraps the forward (deprecate_kwarg, can_return_tuple): the name must be one
    # its own forward declares, read through the wrappers, not whatever they accept as **kwargs.
    model_class = Qwen2_5OmniTalkerForConditionalGeneration
    talker = model_class.__new__(model_class)  # the class is what is read; no weights needed
    assert cache_keyword(talker) in inspect.signature(model_class.forward).parameters
