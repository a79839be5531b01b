"""The 4th family, chime (tests/families/chime), in one process: every hop but the smallest
through shared memory, the reply equal to its model bit for bit, each step's events in plan
order, and no lease left once the reply is read."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from omni_common.chat import chat_request
from omni_common.client import Client
from omni_common.models.registry import FAMILIES_ENV
from tests.families.chime.model import build_tiny_fixture, reference_generate
from tests.integration.conftest import InProcessCluster
from tests.integration.test_generate import wait_until_no_leases


@pytest.fixture(scope="module")
def chime_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessCluster]:
    model = build_tiny_fixture(tmp_path_factory.mktemp("models") / "chime-tiny", seed=5)
    with pytest.MonkeyPatch.context() as env:
        env.setenv(FAMILIES_ENV, "tests.families.chime:ENTRY")  # the registry line
        running = InProcessCluster(model)
        running.start()
        yield running
        running.stop()


def test_a_reply_equals_the_model_and_leaves_no_lease(chime_cluster: InProcessCluster) -> None:
    with Client(chime_cluster.coordinator) as client:
        events = list(client.stream(chat_request("a bell", seed=4, options={"frames": 40})))
        reply = client.speak("a bell", seed=4, options={"frames": 40})
    steps = [e.stage_finished.step for e in events if e.HasField("stage_finished")]
    assert steps == ["encode", "denoise", "vocode"]
    assert [e.step.step for e in events if e.HasField("step")] == [1, 2, 3, 4]
    expected = reference_generate(chime_cluster.model_dir, "a bell", seed=4, steps=4, frames=40)
    np.testing.assert_array_equal(reply.audio, expected.numpy())
    wait_until_no_leases(chime_cluster)


def test_the_model_directory_names_its_family(chime_cluster: InProcessCluster) -> None:
    with Client(chime_cluster.coordinator) as client:
        (info,) = client.list_models()
    assert (info.family, dict(info.roles)) == ("chime", {"text-encoder": 1, "denoise": 1, "vocoder": 1})
    assert Path(chime_cluster.model_dir).name == info.name
