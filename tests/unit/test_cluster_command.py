"""`omnistage cluster up --model DIR [--name NAME]`: which model every stage serves, under which
name, and the ready line a new user reads (no processes started here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_common.cluster import is_stage
from omni_common.compose import load_compose, local_plan
from omnistage_cli.cluster_command import ready_line, with_model
from omnistage_cli.main import build_parser

REPO = Path(__file__).resolve().parents[2]


def compose_plan(env: dict[str, str] | None = None):
    return local_plan(load_compose(REPO / "docker-compose.yml", env or {}), REPO)


def test_model_points_every_stage_and_nothing_else_at_the_directory(tmp_path: Path) -> None:
    model = tmp_path / "glm-image-tiny"
    model.mkdir()
    plan = with_model(compose_plan(), str(model), "")
    stages = [p for p in plan if is_stage(p)]
    assert len(stages) == 3 and all(p.environment["OMNISTAGE_MODEL"] == str(model) for p in stages)
    assert all("OMNISTAGE_MODEL" not in p.environment for p in plan if not is_stage(p))
    assert "serving glm-image-tiny;" in ready_line(plan, "127.0.0.1:50051", "")  # the directory's name


def test_name_gives_the_served_name(tmp_path: Path) -> None:
    plan = with_model(compose_plan(), str(tmp_path), "my-model")
    assert {p.environment.get("OMNISTAGE_MODEL_NAME") for p in plan if is_stage(p)} == {"my-model"}
    assert "serving my-model;" in ready_line(plan, "127.0.0.1:50051", "")


def test_without_model_the_compose_files_model_is_served() -> None:
    plan = with_model(compose_plan(), "", "")
    assert plan == compose_plan()
    assert "serving qwen-image-digits;" in ready_line(plan, "127.0.0.1:50051", "http://127.0.0.1:8000")


def test_a_missing_directory_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no such model directory"):
        with_model(compose_plan(), str(tmp_path / "nope"), "")


def test_omnistage_model_in_the_environment_is_the_default_of_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNISTAGE_MODEL", "/models/x")
    monkeypatch.setenv("OMNISTAGE_MODEL_NAME", "x-name")
    args = build_parser().parse_args(["cluster", "up"])
    assert (args.model, args.name) == ("/models/x", "x-name")


def test_the_ready_line_of_a_tls_cluster_names_the_ca_a_client_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    line = ready_line(compose_plan(), "127.0.0.1:50051", "http://127.0.0.1:8000")
    assert "coordinator at 127.0.0.1:50051 (TLS: clients need --ca-cert .secrets/tls/ca.pem)" in line
    assert line.startswith("cluster ready: ") and "try it at http://127.0.0.1:8000/" in line
