"""docker-compose.yml is valid and the local launcher runs exactly what it declares."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from omni_common.compose import interpolate, load_compose, local_plan

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"


def test_docker_compose_accepts_the_file() -> None:
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose (Debian's package) is not installed; scripts/setup.sh installs it")
    done = subprocess.run(
        ["docker-compose", "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_compose_declares_the_coordinator_one_service_per_stage_and_the_gateway() -> None:
    doc = yaml.safe_load(COMPOSE.read_text())
    assert set(doc["services"]) == {"coordinator", "ar-encoder", "dit-denoise", "vae-decode", "gateway"}
    for name, body in doc["services"].items():
        if name != "gateway":  # the gateway holds no tensors
            assert body["ipc"] == "host", f"{name} must share /dev/shm with the other stages"
        assert body["healthcheck"]["test"][:3] == ["CMD", "omnistage", "health"]
        assert body["command"][:2] == ["omnistage", "serve"] and body["command"][2] == name
    # The gateway is probed over HTTP, on the port it serves.
    gateway = doc["services"]["gateway"]
    port = gateway["environment"]["OMNISTAGE_PORT"]
    assert gateway["healthcheck"]["test"][-1] == f"http://127.0.0.1:{port}/health"
    assert gateway["environment"]["OMNISTAGE_COORDINATOR"] == "coordinator:50051"


def test_launcher_runs_exactly_the_declared_commands_and_environment() -> None:
    env = {"OMNISTAGE_MODELS": "/srv/models"}
    specs = load_compose(COMPOSE, env)
    plan = local_plan(specs, REPO)
    doc = yaml.safe_load(COMPOSE.read_text())
    names = [p.name for p in plan]
    assert names[-2:] == ["coordinator", "gateway"], "stages start before the coordinator, the gateway after"
    assert {p.name for p in plan} == set(doc["services"])
    for process in plan:
        declared = doc["services"][process.name]
        assert process.argv == [sys.executable, "-m", "omnistage_cli", *declared["command"][1:]]
        assert set(process.environment) == set(declared["environment"])
        for key, value in declared["environment"].items():
            raw = interpolate(str(value), env)
            local = process.environment[key]
            if raw.startswith("/models/"):
                assert local == "/srv/models/" + raw.removeprefix("/models/")
            elif raw == "/cache/compile":  # the compile cache volume's source, beside the file
                assert local == str(REPO / ".cache" / "compile")
            elif raw.startswith("/run/omnistage-secrets/"):  # the secrets volume's source
                assert local == str(REPO / ".secrets" / raw.removeprefix("/run/omnistage-secrets/"))
            elif raw in doc["services"] or raw == "0.0.0.0":
                assert local == "127.0.0.1"
            elif ":" in raw and raw.split(":")[0] in doc["services"]:
                assert local == "127.0.0.1:" + raw.split(":")[1]
            else:
                assert local == raw
        assert process.health_address == declared["healthcheck"]["test"][-1]


def test_interpolation_follows_compose_rules() -> None:
    assert interpolate("${A:-x}/${B}", {"A": "a"}) == "a/"
    assert interpolate("${A:-x}", {}) == "x"
    assert interpolate("${A:-x}", {"A": ""}) == "x"


def test_a_scaled_gateway_replica_moves_its_http_health_url_with_its_port() -> None:
    plan = local_plan(load_compose(COMPOSE, {}), REPO, {"gateway": 2})
    first, second = (p for p in plan if p.name.startswith("gateway"))
    assert first.health_address == "http://127.0.0.1:8000/health"
    assert second.health_address == "http://127.0.0.1:8100/health"
    assert second.environment["OMNISTAGE_PORT"] == "8100"
