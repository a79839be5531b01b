"""Routing with LoRA adapters: a request goes to a dit-denoise replica that holds its adapters,
even a busier one; without adapters the least-loaded replica wins as before."""

from __future__ import annotations

from omnistage.v1 import stage_pb2
from services.coordinator.registry import Replica, ReplicaPool


def pool_of(*replicas: tuple[str, list[str], int]) -> ReplicaPool:
    pool = ReplicaPool()
    pool.replicas["dit-denoise"] = []
    for address, loras, load in replicas:
        info = stage_pb2.StageInfo(
            stage="dit-denoise",
            model="m",
            family="qwenimage",
            host_id="h",
            address=address,
            load=load,
            loras=loras,
        )
        pool.replicas["dit-denoise"].append(Replica("dit-denoise", address, None, info=info))  # type: ignore[arg-type]
    return pool


def test_the_replica_holding_the_adapters_wins_over_a_less_loaded_one() -> None:
    pool = pool_of(("idle:1", [], 0), ("busy:1", ["a", "b"], 900), ("half:1", ["a"], 10))
    assert pool.pick("dit-denoise", "m").address == "idle:1"
    assert pool.pick("dit-denoise", "m", loras=frozenset({"a"})).address == "half:1"
    assert pool.pick("dit-denoise", "m", loras=frozenset({"a", "b"})).address == "busy:1"
    # nobody holds "c": the one missing the fewest adapters, then the least loaded
    assert pool.pick("dit-denoise", "m", loras=frozenset({"c"})).address == "idle:1"
    assert pool.pick("dit-denoise", "m", loras=frozenset({"b", "c"})).address == "busy:1"


def test_model_views_count_the_replicas_holding_each_adapter() -> None:
    pool = pool_of(("x:1", ["a"], 0), ("y:1", ["a", "b"], 0))
    assert pool.models()["m"].loras == {"a": 2, "b": 1}
