"""SIGTERM drains a stage: its in-flight request finishes, then it exits and frees its
shared memory; the cluster refuses new work for that stage with a clear status."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest

from omni_common.client import Client
from omni_common.cluster import LocalCluster, loopback_plan
from omni_common.errors import OmniError, Unavailable
from tests.conftest import assert_no_segment_added, omnistage_segments

pytestmark = pytest.mark.slow


def test_sigterm_mid_request_finishes_it_then_exits_clean(tiny_model: Path, tmp_path: Path) -> None:
    before = omnistage_segments()
    # A request for a stage with no replica waits this long for one, then is UNAVAILABLE.
    plan = loopback_plan(tiny_model, extra_env={"OMNISTAGE_REPLICA_WAIT_S": "1"})
    with LocalCluster(plan, log_dir=tmp_path) as cluster:
        address = cluster.coordinator
        denoiser = cluster.processes["dit-denoise"]
        steps: list[int] = []
        outcome: list[object] = []

        def generate() -> None:
            with Client(address) as client:
                try:
                    for event in client.events("drain me", width=64, height=64, steps=40):
                        if event.HasField("step"):
                            steps.append(event.step.step)
                        if event.HasField("result"):
                            outcome.append(event.result)
                except OmniError as err:
                    outcome.append(err)

        thread = threading.Thread(target=generate)
        thread.start()
        deadline = time.monotonic() + 60
        while len(steps) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        denoiser.send_signal(signal.SIGTERM)
        thread.join(60)
        assert len(outcome) == 1 and not isinstance(outcome[0], OmniError), outcome
        assert steps[-1] == 40
        assert denoiser.wait(30) == 0
        with Client(address) as client, pytest.raises(Unavailable, match="dit-denoise"):
            client.generate("after", width=64, height=64, steps=2)
    assert_no_segment_added(before)
