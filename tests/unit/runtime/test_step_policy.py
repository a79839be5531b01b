"""The step scheduler's choices (runtime/step_policy.py) on plain values, no runner or model:
first come first served by batch key, the batch and cost bounds, readiness, streams that step
longest-ago first, deadlines and callers that leave, and the wait of a new batch for company."""

from __future__ import annotations

import pytest

from omni_common.runtime.step_policy import (
    ADMIT_WAIT_S,
    FOLLOWERS_WAIT_S,
    Queued,
    StepLimits,
    StepPlan,
    company_wait_s,
    plan_step,
)

LIMITS = StepLimits(max_batch=4, max_tokens=100)


def plan(
    queued: list[Queued],
    limits: StepLimits = LIMITS,
    now: float = 10.0,
    admitting: int = 0,
    streaming: bool = False,
) -> StepPlan:
    return plan_step(queued, limits, now=now, admitting=admitting, streaming=streaming)


def test_the_oldest_request_picks_its_batch_key_group_even_when_a_later_group_is_larger() -> None:
    queued = [
        Queued("512", 10),
        Queued("1024", 10),
        Queued("1024", 10),
        Queued("512", 10),
        Queued("1024", 10),
    ]
    assert plan(queued).batch == (0, 3)


def test_requests_of_other_keys_are_passed_over_not_waited_behind() -> None:
    queued = [Queued("a", 10), Queued("b", 10), Queued("a", 10), Queued("b", 10), Queued("a", 10)]
    assert plan(queued).batch == (0, 2, 4)
    assert plan(queued[1:]).batch == (0, 2)  # once the first group is done, the next oldest leads


def test_the_batch_stops_at_max_batch_in_arrival_order() -> None:
    queued = [Queued("k", 1) for _ in range(7)]
    assert plan(queued).batch == (0, 1, 2, 3)
    assert plan(queued, StepLimits(max_batch=1)).batch == (0,)


def test_the_cost_budget_skips_a_request_that_does_not_fit_and_takes_a_later_one_that_does() -> None:
    queued = [Queued("k", 60), Queued("k", 50), Queued("k", 40), Queued("k", 1)]
    assert plan(queued).batch == (0, 2)  # 60 + 40 = 100; 50 and then 1 would pass it
    queued = [Queued("k", 60), Queued("k", 50), Queued("k", 30), Queued("k", 10)]
    assert plan(queued).batch == (0, 2, 3)


def test_the_oldest_request_steps_even_when_it_alone_passes_the_budget() -> None:
    queued = [Queued("k", 500), Queued("k", 1)]
    assert plan(queued).batch == (0,)


def test_requests_that_are_not_ready_neither_step_nor_lead() -> None:
    queued = [Queued("a", 1, ready=False), Queued("b", 1), Queued("a", 1)]
    assert plan(queued).batch == (1,)
    assert plan([Queued("a", 1, ready=False)]).batch == ()


def test_streams_step_the_one_that_stepped_longest_ago_first_ties_in_arrival_order() -> None:
    queued = [
        Queued("k", 1, last_step=5.0),
        Queued("k", 1, last_step=2.0),
        Queued("x", 1, last_step=0.0),  # new: never stepped, and leads
        Queued("k", 1, last_step=2.0),
    ]
    assert plan(queued, streaming=True).batch == (2,)
    assert plan(queued[:2] + queued[3:], streaming=True).batch == (1, 2, 0)
    assert plan(queued[:2] + queued[3:]).batch == (0, 1, 2)  # not streaming: arrival order


def test_requests_past_their_deadline_expire_and_gone_ones_leave_before_the_choice() -> None:
    queued = [
        Queued("k", 1, deadline=9.0),
        Queued("k", 1, deadline=10.0),  # now == deadline: expired
        Queued("k", 1, deadline=11.0),
        Queued("k", 1, gone=True, deadline=1.0),  # gone, not expired
        Queued("k", 1),
    ]
    chosen = plan(queued, now=10.0)
    assert (chosen.expired, chosen.gone, chosen.batch) == ((0, 1), (3,), (2, 4))


def test_a_request_joins_the_running_batch_between_steps_and_a_finished_one_leaves() -> None:
    running = [Queued("k", 1, step_index=3, last_step=9.0), Queued("k", 1, step_index=1, last_step=9.0)]
    joined = [*running, Queued("k", 1, admitted=9.5)]
    assert plan(joined).batch == (0, 1, 2)
    assert plan(joined).wait_s == 0.0  # a batch that has stepped never waits for company
    assert plan(joined[1:]).batch == (0, 1)  # the first finished: the rest go on


def test_a_new_batch_waits_for_requests_being_admitted_from_its_first_admission() -> None:
    batch = [Queued("k", 1, admitted=9.98), Queued("k", 1, admitted=9.99)]
    assert company_wait_s(batch, LIMITS, now=10.0, admitting=1) == pytest.approx(ADMIT_WAIT_S - 0.02)
    assert company_wait_s(batch, LIMITS, now=10.0, admitting=0) == 0.0
    assert company_wait_s(batch, LIMITS, now=10.0 + ADMIT_WAIT_S, admitting=1) == 0.0


def test_a_new_batch_waits_for_the_followers_its_calls_announced_until_it_is_full() -> None:
    alone = [Queued("k", 1, admitted=10.0, followers=2)]
    assert company_wait_s(alone, LIMITS, now=10.0) == FOLLOWERS_WAIT_S
    arrived = [Queued("k", 1, admitted=10.0, followers=2), Queued("k", 1, admitted=10.0), Queued("k", 1)]
    assert company_wait_s(arrived, LIMITS, now=10.0) == 0.0  # all three are here
    full = [Queued("k", 1, admitted=10.0, followers=9) for _ in range(4)]
    assert company_wait_s(full, LIMITS, now=10.0) == 0.0


def test_the_batch_window_holds_a_new_batch_even_with_no_one_being_admitted() -> None:
    window = StepLimits(max_batch=4, batch_window_s=0.5)
    assert company_wait_s([Queued("k", 1, admitted=10.0)], window, now=10.2) == pytest.approx(0.5 - 0.2)
    resumed = [Queued("k", 1, admitted=10.0, step_index=7)]  # resumed mid-way: steps at once
    assert company_wait_s(resumed, window, now=10.2) == 0.0


def test_streams_never_wait_for_company() -> None:
    queued = [Queued("k", 1, admitted=10.0, followers=3)]
    assert plan(queued, now=10.0, admitting=2).wait_s == FOLLOWERS_WAIT_S
    assert plan(queued, now=10.0, admitting=2, streaming=True).wait_s == 0.0


def test_nothing_queued_plans_nothing() -> None:
    assert plan([]) == StepPlan()
