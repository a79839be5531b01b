"""`omnistage cluster up`: the local cluster of docker-compose.yml, for the model a user names.

What a user sees is this module's: which model is served and under which name, the ready line
(with what a client needs to reach a TLS cluster), and one line that names the service and
the cause when a start fails, never a Python traceback.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # `omnistage --help` builds the parser without the cluster's imports
    from omni_common.compose import LocalProcess

DEFAULT_MODEL_NAME = "qwen-image-tiny"


def add_cluster_up_args(up: argparse.ArgumentParser) -> None:
    """The flags of `omnistage cluster up`."""
    up.add_argument("--compose", default="docker-compose.yml", help="the compose file whose services to run")
    up.add_argument(
        "--model",
        default=os.environ.get("OMNISTAGE_MODEL", ""),
        metavar="DIR",
        help="the model directory every stage serves, e.g. a fixture of `omnistage fixture` "
        "(default: OMNISTAGE_MODEL; neither: the compose file's, models/qwen-image-digits)",
    )
    up.add_argument(
        "--name",
        default=os.environ.get("OMNISTAGE_MODEL_NAME", ""),
        help="the name the model is served under, for --model and `omnistage models` "
        "(default: OMNISTAGE_MODEL_NAME; neither: the model directory's name)",
    )
    up.add_argument("--logs", default="", help="directory for one log file per service")
    up.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for health")
    up.add_argument(
        "--scale",
        action="append",
        default=[],
        metavar="SERVICE=N",
        help="run N replicas of a service (repeatable), e.g. --scale dit-denoise=3",
    )


def with_model(plan: list[LocalProcess], model: str, name: str) -> list[LocalProcess]:
    """The plan with every stage serving `model` (a directory; "" keeps the compose file's),
    under `name` ("" keeps the directory's name). One naming rule, the stages' own: a model is
    served under its directory's name unless a name is given."""
    from omni_common.cluster import is_stage

    if not model and not name:
        return plan
    extra: dict[str, str] = {}
    if model:
        path = Path(model).expanduser().resolve()
        if not path.is_dir():
            raise SystemExit(f"error: --model {model}: no such model directory")
        extra["OMNISTAGE_MODEL"] = str(path)
    if name:
        extra["OMNISTAGE_MODEL_NAME"] = name
    return [replace(p, environment={**p.environment, **extra}) if is_stage(p) else p for p in plan]


def ensure_default_model(plan: list[LocalProcess]) -> None:
    """Build the embedded tiny model the first time the default cluster starts."""
    from omni_common.models.qwenimage.fixture import build_tiny_fixture

    for proc in plan:
        model = proc.environment.get("OMNISTAGE_MODEL")
        if model and not Path(model).exists() and Path(model).name == DEFAULT_MODEL_NAME:
            print(f"building the default model {DEFAULT_MODEL_NAME} in {model}", flush=True)
            build_tiny_fixture(Path(model))


def _parse_scale(item: str) -> tuple[str, int]:
    name, sep, count = item.partition("=")
    if not sep or not count.isdigit() or int(count) < 1:
        raise SystemExit(f"--scale takes SERVICE=N with N >= 1, not {item!r}")
    return name, int(count)


def ready_line(plan: list[LocalProcess], coordinator: str, gateway: str) -> str:
    """What `cluster up` prints once every service is healthy: the services, the model, where
    to call, and, for a TLS cluster, the CA file a client must pass."""
    from omni_common.cluster import is_stage

    page = f"; try it at {gateway}/" if gateway else ""
    served = {_served_name(p) for p in plan if is_stage(p)} - {""}
    model = f"; serving {', '.join(sorted(served))}" if served else ""
    coordinator_env = next((p.environment for p in plan if p.name == "coordinator"), {})
    ca = coordinator_env.get("OMNISTAGE_TLS_CA", "")
    tls = f" (TLS: clients need --ca-cert {_shown(ca)})" if ca else ""
    return (
        f"cluster ready: {', '.join(p.name for p in plan)}{model}; "
        f"coordinator at {coordinator}{tls}{page}. Ctrl-C stops it."
    )


def _served_name(proc: LocalProcess) -> str:
    model = proc.environment.get("OMNISTAGE_MODEL", "")
    return (
        proc.environment.get("OMNISTAGE_MODEL_NAME")
        or os.environ.get("OMNISTAGE_MODEL_NAME")
        or Path(model).name
    )


def _shown(path: str) -> str:
    """`path` relative to the working directory when it lies below it (what a user types)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return path


def cluster_up(args: argparse.Namespace) -> int:
    """Start the cluster, wait for health, serve until SIGINT/SIGTERM, stop everything."""
    from omni_common.cluster import LocalCluster
    from omni_common.compose import load_compose, local_plan
    from omni_common.errors import OmniError
    from omni_common.transport import sweep_stale_segments

    compose = Path(args.compose).resolve()
    if not compose.is_file():
        raise SystemExit(f"error: --compose {args.compose}: no such file")
    scale = dict(_parse_scale(item) for item in args.scale)
    try:
        plan = local_plan(load_compose(compose), compose.parent, scale)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    plan = with_model(plan, args.model, args.name)
    ensure_default_model(plan)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    cluster = LocalCluster(plan, log_dir=Path(args.logs) if args.logs else None)
    try:
        try:
            cluster.start(timeout_s=args.timeout)
        except OmniError as err:
            # One line that names the service and the cause (LocalCluster.start read it from
            # the service's own output); the logs hold the rest.
            print(f"error: {err.message.splitlines()[0]}", file=sys.stderr)
            return 1
        print(ready_line(plan, cluster.coordinator, cluster.gateway), flush=True)
        stop.wait()
        print("stopping the cluster", flush=True)
    finally:
        cluster.stop()
        sweep_stale_segments()
    return 0
