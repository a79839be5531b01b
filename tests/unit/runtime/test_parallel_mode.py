"""choose_mode with plain values: where a request of a replica over several devices runs, by the
batch in flight, its step's image tokens (CFG counted twice), CFG and the number of devices."""

from __future__ import annotations

import logging

import pytest

from omni_common.runtime.parallel_mode import (
    CFG_PARALLEL,
    DATA_PARALLEL,
    ONE_DEVICE,
    SEQUENCE_PARALLEL,
    ModeLog,
    ParallelPolicy,
    choose_mode,
    spreads,
)

AUTO = ParallelPolicy()
# Qwen-Image's image tokens of one step: (W/16)(H/16), doubled by CFG.
AT_512, AT_1024, AT_2048 = 1024, 4096, 16384


@pytest.mark.parametrize(
    ("batch", "tokens", "cfg", "world", "mode"),
    [
        # 2 H100s, the replica, 2 GPUs / 1 GPU at 512: CFG parallel 0.533 (no more GPU time),
        # spread without CFG 0.764 (a burst's requests count as in flight: one rank each).
        (1, AT_512, False, 2, SEQUENCE_PARALLEL),
        (1, AT_512 // 2, False, 2, ONE_DEVICE),
        (1, 2 * AT_512, True, 2, CFG_PARALLEL),
        (1, AT_512 // 2, True, 2, ONE_DEVICE),  # 362x362 with CFG: not timed spread
        (1, AT_1024, False, 2, SEQUENCE_PARALLEL),
        (1, 2 * AT_1024, True, 2, CFG_PARALLEL),  # 0.52
        (1, AT_2048, False, 2, SEQUENCE_PARALLEL),
        (1, 2 * AT_2048, True, 2, CFG_PARALLEL),
        (1, 2 * AT_1024, True, 3, SEQUENCE_PARALLEL),  # CFG needs an even world
        (1, 2 * AT_2048, True, 3, SEQUENCE_PARALLEL),
        (2, AT_2048, False, 2, DATA_PARALLEL),  # two requests on two devices at once
        (2, 2 * AT_1024, True, 2, DATA_PARALLEL),
        (2, AT_2048, False, 4, SEQUENCE_PARALLEL),  # two devices would stay idle otherwise
        (4, AT_512, False, 4, DATA_PARALLEL),
        (8, AT_512, False, 2, DATA_PARALLEL),
        (1, AT_2048, True, 1, ONE_DEVICE),  # one device: nothing to choose
    ],
)
def test_auto_splits_only_a_lone_request_large_enough_to_pay(
    batch: int, tokens: int, cfg: bool, world: int, mode: str
) -> None:
    assert choose_mode(batch, tokens, cfg, world, AUTO) == mode


def test_the_thresholds_are_settings() -> None:
    eager = ParallelPolicy(cfg_parallel_tokens=8192, sequence_parallel_tokens=1024)
    assert choose_mode(1, AT_512, False, 2, eager) == SEQUENCE_PARALLEL
    assert choose_mode(1, 2 * AT_512, True, 2, eager) == SEQUENCE_PARALLEL
    assert choose_mode(1, 2 * AT_1024, True, 2, eager) == CFG_PARALLEL
    assert choose_mode(2, 2 * AT_512, True, 2, eager) == DATA_PARALLEL


def test_a_forced_policy_holds_whatever_the_shape() -> None:
    split, apart = ParallelPolicy("sequence-parallel"), ParallelPolicy("data-parallel")
    assert choose_mode(8, AT_512, False, 2, split) == SEQUENCE_PARALLEL
    assert choose_mode(8, AT_512, True, 2, split) == CFG_PARALLEL
    assert choose_mode(8, AT_512, True, 3, split) == SEQUENCE_PARALLEL
    assert choose_mode(1, AT_2048, True, 2, apart) == ONE_DEVICE
    assert choose_mode(2, AT_2048, True, 2, apart) == DATA_PARALLEL


@pytest.mark.parametrize(
    ("rows", "tokens", "world", "policy", "spread"),
    [
        (1, AT_1024, 2, AUTO, True),  # sequence parallel
        (1, AT_512, 2, AUTO, True),  # sequence parallel; with CFG, each branch alone on one
        (1, AT_512 // 2, 2, AUTO, False),
        (2, AT_2048, 2, AUTO, False),  # a second request goes to the other device
        (1, AT_1024, 3, AUTO, True),
        (1, AT_512 * 2, 3, AUTO, True),  # with CFG (counted twice) on an odd world: sequence parallel
        (3, AT_2048, 4, AUTO, True),  # three requests split while a fourth device is left
        (4, AT_2048, 4, AUTO, False),
        (1, AT_512, 4, AUTO, True),  # CFG on 4: each branch over a half of 2
        (8, AT_512, 2, ParallelPolicy("sequence-parallel"), True),
        (1, AT_2048, 2, ParallelPolicy("data-parallel"), False),
        (1, AT_2048, 1, AUTO, False),
    ],
)
def test_the_forwards_a_replica_may_spread(
    rows: int, tokens: int, world: int, policy: ParallelPolicy, spread: bool
) -> None:
    """What a replica compiles spread before it serves: the forwards some request, with or
    without CFG, could take spread under its policy."""
    assert spreads(rows, tokens, world, policy) == spread


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="parallel mode 'ring'; it is one of auto, sequence-parallel"):
        ParallelPolicy("ring")


def test_the_choice_is_logged_when_it_changes(caplog: pytest.LogCaptureFixture) -> None:
    modes = ModeLog()
    with caplog.at_level(logging.INFO, logger="omnistage.parallel_mode"):
        for mode, batch in [(ONE_DEVICE, 1), (ONE_DEVICE, 1), (DATA_PARALLEL, 2), (ONE_DEVICE, 1)]:
            modes.chose(mode, batch, AT_512, False)
    assert [record.getMessage() for record in caplog.records] == [
        "parallel mode one-device (requests in flight or arriving 1, step tokens 1024, cfg False)",
        "parallel mode data-parallel (requests in flight or arriving 2, step tokens 1024, cfg False)",
        "parallel mode one-device (requests in flight or arriving 1, step tokens 1024, cfg False)",
    ]
