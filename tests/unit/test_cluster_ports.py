"""free_port: the loopback ports a local cluster's processes are given are distinct, even when the
system offers a port again that an earlier probe returned (it stays free until its taker binds
it: a coordinator and a stage were once both given one, and the stage failed to bind)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from omni_common import cluster
from omni_common.compose import LOOPBACK


def test_a_port_the_system_offers_again_is_not_handed_out_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    # The system's choice cannot be steered, so its offers are replayed: 41001 three times.
    offered = iter([41001, 41001, 41001, 41002])
    monkeypatch.setattr(cluster, "_probe_port", lambda: next(offered))
    monkeypatch.setattr(cluster, "_PORTS_GIVEN", set())
    assert [cluster.free_port(), cluster.free_port()] == [41001, 41002]


def test_a_port_handed_out_can_be_bound_and_a_plans_ports_are_distinct() -> None:
    port = cluster.free_port()
    with socket.socket() as sock:
        sock.bind((LOOPBACK, port))
    plan = cluster.loopback_plan(Path("model"), replicas={"dit-denoise": 3})
    addresses = [proc.health_address for proc in plan]
    assert len(addresses) == 6 and len(set(addresses)) == len(addresses)
    assert f"{LOOPBACK}:{port}" not in addresses
