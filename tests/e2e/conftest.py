"""Real processes: each service started through the `omnistage` CLI, as in production."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from omni_common.cluster import LocalCluster, loopback_plan


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def process_cluster(
    request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    """(coordinator address, dtype) of a cluster of real processes."""
    dtype = request.param
    # fp32 keeps the default inline threshold (small hops inline); bf16 sends every hop
    # through shared memory, so both paths are checked across real processes.
    extra = {} if dtype == "float32" else {"OMNISTAGE_INLINE_BYTES": "0"}
    plan = loopback_plan(tiny_model, dtype, extra)
    with LocalCluster(plan, log_dir=tmp_path_factory.mktemp(f"logs-{dtype}")) as cluster:
        yield cluster.coordinator, dtype
