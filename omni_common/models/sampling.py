"""How a continuously batched generator picks each request's next token, as transformers'
`generate` picks it for that request alone: float32 scores of the last position, the logits
processors `generate` builds from the model's generation config, then argmax (greedy) or
softmax + multinomial (sampling) from the request's own generator, so that a request's tokens
do not depend on its batch mates.
"""

from __future__ import annotations

import copy
import weakref
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


@dataclass(eq=False)
class Sampling:
    """One request's token choice: its processors, greedy or not, and its generator."""

    processors: LogitsProcessorList
    do_sample: bool
    generator: torch.Generator
    # Equal for requests whose processors can run as one batch; None when they read more
    # than their row's scores (e.g. a repetition penalty reads the tokens seen).
    key: Hashable | None
    # Equal for requests one graphed decode step takes (graphed_decode.py): the key, where a
    # leading repetition penalty is allowed (the step keeps each row's tokens seen as a mask).
    graph_key: Hashable | None = None

    @property
    def penalty(self) -> float | None:
        """Its leading repetition penalty's factor, if it has one."""
        return split_penalty(self.processors)[0]

    @classmethod
    def build(cls, model: Any, input_ids: torch.Tensor, total: int, seed: int, **generation: Any) -> Sampling:
        """What `model.generate(input_ids, max_new_tokens=total, **generation)` would apply,
        with a generator seeded with `seed` on the input's device."""
        config = prepared_config(model, input_ids.device, total, generation)
        processors = logits_processors(model, config, input_ids, total)
        generator = torch.Generator(input_ids.device).manual_seed(seed)
        do_sample = bool(config.do_sample)
        key = row_wise_key(processors, do_sample)
        return cls(processors, do_sample, generator, key, graph_key(processors, do_sample))


def prepared_config(model: Any, device: torch.device, total: int, generation: dict[str, Any]) -> Any:
    """A copy of `model._prepare_generation_config(None, max_new_tokens=total, **generation)`'s
    config with its special tokens prepared on `device` (`_prepare_special_tokens`), prepared
    once per settings and model: transformers 5.17 builds and validates the model's whole
    config to prepare one (~30 ms of a request's host time on an H100's host), and the special
    tokens' small copies and checks each wait for the device. A shallow copy: what a request
    sets on it (`logits_processors`) is its own."""
    key = _key(device, total, generation)
    kept = _PREPARED.setdefault(model, OrderedDict())
    config = None if key is None else kept.get(key)
    if config is None:
        config, _ = model._prepare_generation_config(None, max_new_tokens=total, **generation)
        model._prepare_special_tokens(config, kwargs_has_attention_mask=True, device=device)
        if key is None:  # settings that cannot be a key: prepared for this request alone
            return config
        kept[key] = config
        if len(kept) > PREPARED_PER_MODEL:
            kept.popitem(last=False)
    kept.move_to_end(key)
    return copy.copy(config)


# Prepared generation configs by model, then by settings (`prepared_config`), the most recent kept.
_PREPARED: weakref.WeakKeyDictionary[Any, OrderedDict[Hashable, Any]] = weakref.WeakKeyDictionary()
PREPARED_PER_MODEL = 64


def _key(device: torch.device, total: int, generation: dict[str, Any]) -> Hashable | None:
    """The settings' key in `_PREPARED` (lists as tuples); None when a setting is not hashable."""
    settings = tuple(sorted((name, tuple(v) if isinstance(v, list) else v) for name, v in generation.items()))
    try:
        hash(settings)
    except TypeError:
        return None
    return (str(device), total, settings)


def logits_processors(model: Any, config: Any, input_ids: torch.Tensor, total: int) -> LogitsProcessorList:
    """What `generate` applies to the logits under `config` (`prepared_config`'s, which this
    completes for the prompt), built by its own (private) helpers: rebuilding the temperature /
    top-k / top-p / penalty rules here would drift from transformers' defaults. Bitwise tests
    against `generate` pin it."""
    config.max_length = input_ids.shape[1] + total
    return cast(
        LogitsProcessorList,
        model._get_logits_processor(
            generation_config=config,
            input_ids_seq_length=input_ids.shape[1],
            encoder_input_ids=input_ids,
            device=input_ids.device,
            model_kwargs={},
        ),
    )


# Processors whose output row depends on that row's scores alone (not on the tokens seen).
ROW_WISE = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    SuppressTokensLogitsProcessor,
)


def row_wise_key(processors: LogitsProcessorList, do_sample: bool = True) -> Hashable | None:
    """What makes two requests' processors interchangeable (their types and settings), or None
    when one of them reads more than its row's scores."""
    if not all(type(processor) in ROW_WISE for processor in processors):
        return None
    return (do_sample, tuple((type(p).__name__, _settings(p)) for p in processors))


def _settings(processor: Any) -> tuple[tuple[str, Hashable], ...]:
    """A processor's settings, hashable (a tensor of token ids as a tuple)."""
    return tuple(
        (name, tuple(value.tolist()) if isinstance(value, torch.Tensor) else value)
        for name, value in sorted(vars(processor).items())
    )


def split_penalty(processors: LogitsProcessorList) -> tuple[float | None, LogitsProcessorList]:
    """A leading repetition penalty's factor (None without one) and the processors after it."""
    first = processors[0] if len(processors) else None
    if isinstance(first, RepetitionPenaltyLogitsProcessor) and first.prompt_ignore_length is None:
        return float(first.penalty), LogitsProcessorList(processors[1:])
    return None, processors


def graph_key(processors: LogitsProcessorList, do_sample: bool = True) -> Hashable | None:
    """The key of one graphed decode step's sampling: `row_wise_key`'s of the processors after
    a leading repetition penalty, with that penalty (None when another reads the tokens seen)."""
    penalty, rest = split_penalty(processors)
    key = row_wise_key(rest, do_sample)
    return None if key is None else (penalty, key)


def pick_tokens(
    rows: Sequence[tuple[Sampling, torch.Tensor]], logits: torch.Tensor
) -> list[torch.Tensor | None]:
    """The next token [1, 1] of each row from `logits` [rows, positions, vocab] (the last
    position is read); each row is (its Sampling, the ids it has seen [1, n]). None for a row
    holding NaN or Inf. Changes nothing but the generators, so a step that fails here can run
    again."""
    scores = logits[:, -1].to(copy=True, dtype=torch.float32)
    finite = torch.isfinite(scores).all(dim=-1).tolist()
    processed = _processed(rows, scores)
    picked: list[torch.Tensor | None] = []
    for row, ((sampling, _), ok) in enumerate(zip(rows, finite, strict=True)):
        if not ok:
            picked.append(None)
        elif sampling.do_sample:
            probs = torch.nn.functional.softmax(processed[row : row + 1], dim=-1)
            picked.append(torch.multinomial(probs, num_samples=1, generator=sampling.generator))
        else:
            picked.append(torch.argmax(processed[row : row + 1], dim=-1, keepdim=True))
    return picked


def _processed(rows: Sequence[tuple[Sampling, torch.Tensor]], scores: torch.Tensor) -> torch.Tensor:
    """processors(scores) of each row. When every row has the same processors and they read
    nothing but their row's scores, one call covers the batch: each row's arithmetic is its
    own either way, and a step's host time is per call. Other processors run per row, over the
    tokens that row has seen."""
    keys = {sampling.key for sampling, _ in rows}
    if len(keys) == 1 and None not in keys:
        processed = scores
        for processor in rows[0][0].processors:
            processed = processor(cast(torch.LongTensor, None), cast(torch.FloatTensor, processed))
        return processed
    return torch.cat(
        [
            sampling.processors(cast(torch.LongTensor, seen), cast(torch.FloatTensor, scores[row : row + 1]))
            for row, (sampling, seen) in enumerate(rows)
        ]
    )
