"""A request's generation config is prepared once per settings (transformers 5.17 spends tens
of milliseconds of host time on each), each request gets its own copy, the processors built
from it are those built from a fresh one, and what is kept is bounded."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from omni_common.models import sampling
from omni_common.models.sampling import Sampling, prepared_config, row_wise_key

SETTINGS = {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.9}


@pytest.fixture
def model() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    config.eos_token_id, config.pad_token_id = 2, 0
    return LlamaForCausalLM(config).eval()


def counting(model: Any) -> list[int]:
    """Counts the model's `_prepare_generation_config` calls (the real method still runs)."""
    calls: list[int] = []
    real = model._prepare_generation_config

    def prepare(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    model._prepare_generation_config = prepare
    return calls


def test_settings_are_prepared_once_and_each_request_gets_its_own_copy(model: LlamaForCausalLM) -> None:
    calls = counting(model)
    short, long = torch.zeros(1, 5, dtype=torch.long), torch.zeros(1, 9, dtype=torch.long)
    first = Sampling.build(model, short, 4, seed=1, **SETTINGS)
    second = Sampling.build(model, long, 4, seed=1, **SETTINGS)
    assert len(calls) == 1
    assert first.key == second.key is not None
    kept = prepared_config(model, short.device, 4, SETTINGS)
    assert kept.max_length not in (5 + 4, 9 + 4)  # no request's prompt length leaked into the kept one
    Sampling.build(model, short, 5, seed=1, **SETTINGS)  # other settings: prepared again
    assert len(calls) == 2


def test_processors_equal_those_of_a_fresh_config(model: LlamaForCausalLM) -> None:
    ids = torch.zeros(1, 6, dtype=torch.long)
    Sampling.build(model, ids, 8, seed=0, **SETTINGS)  # prepares and keeps
    cached = Sampling.build(model, ids, 8, seed=0, **SETTINGS)
    fresh, _ = model._prepare_generation_config(None, max_new_tokens=8, **SETTINGS)
    model._prepare_special_tokens(fresh, kwargs_has_attention_mask=True, device=ids.device)
    expected = sampling.logits_processors(model, fresh, ids, 8)
    assert [type(p) for p in cached.processors] == [type(p) for p in expected]
    assert cached.key == row_wise_key(expected, True)


def test_what_is_kept_is_bounded(model: LlamaForCausalLM) -> None:
    ids = torch.zeros(1, 3, dtype=torch.long)
    for total in range(sampling.PREPARED_PER_MODEL + 10):
        Sampling.build(model, ids, total + 1, seed=0, do_sample=False)
    assert len(sampling._PREPARED[model]) == sampling.PREPARED_PER_MODEL


def test_settings_that_cannot_be_a_key_are_prepared_each_time(model: LlamaForCausalLM) -> None:
    calls = counting(model)
    ids = torch.zeros(1, 3, dtype=torch.long)
    unhashable = {"do_sample": False, "sequence_bias": {(5,): -1.0}}  # a dict: no key
    for _ in range(2):
        built = Sampling.build(model, ids, 4, seed=0, **unhashable)
        assert any(type(p).__name__ == "SequenceBiasLogitsProcessor" for p in built.processors)
    assert len(calls) == 2
