"""`omnistage cluster up`: run the services of docker-compose.yml as local processes.

The compose file is the single description of the cluster. This launcher starts exactly
its services, commands and environments, with three translations for one host without
Docker: a service name used as a host and 0.0.0.0 become 127.0.0.1, a volume target
becomes its source directory, and the `omnistage` command runs from this interpreter.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from omni_common.errors import Unavailable

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class ServiceSpec:
    """One service of the compose file, as declared (after ${VAR:-default} interpolation)."""

    name: str
    command: list[str]
    environment: dict[str, str]
    depends_on: list[str]
    volumes: list[tuple[str, str]]
    health_address: str


@dataclass(frozen=True)
class LocalProcess:
    """What the launcher runs for a service."""

    name: str
    argv: list[str]
    environment: dict[str, str]
    health_address: str


def interpolate(value: str, env: dict[str, str]) -> str:
    return _VAR.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), value)


def load_compose(path: Path, env: dict[str, str] | None = None) -> list[ServiceSpec]:
    """Services of a compose file in start order (dependencies first)."""
    env = dict(os.environ) if env is None else env
    doc = yaml.safe_load(path.read_text())
    specs: dict[str, ServiceSpec] = {}
    for name, body in doc["services"].items():
        command = [interpolate(str(part), env) for part in body["command"]]
        environment = {k: interpolate(str(v), env) for k, v in (body.get("environment") or {}).items()}
        volumes = []
        for volume in body.get("volumes") or []:
            source, target = interpolate(volume, env).split(":")[:2]
            volumes.append((source, target))
        test = body["healthcheck"]["test"]
        specs[name] = ServiceSpec(
            name=name,
            command=command,
            environment=environment,
            depends_on=sorted(body.get("depends_on") or []),
            volumes=volumes,
            health_address=str(test[-1]),
        )
    return _start_order(specs)


def _start_order(specs: dict[str, ServiceSpec]) -> list[ServiceSpec]:
    ordered: list[ServiceSpec] = []
    seen: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in path:
            raise ValueError(f"dependency cycle: {' -> '.join((*path, name))}")
        if name in seen:
            return
        for dep in specs[name].depends_on:
            visit(dep, (*path, name))
        seen.add(name)
        ordered.append(specs[name])

    for name in specs:
        visit(name, ())
    return ordered


def local_plan(specs: list[ServiceSpec], compose_dir: Path) -> list[LocalProcess]:
    """The processes that run `specs` on this host."""
    names = {spec.name for spec in specs}

    def local_path(value: str, volumes: list[tuple[str, str]]) -> str:
        for source, target in volumes:
            if value == target or value.startswith(target + "/"):
                return str((compose_dir / source).resolve()) + value[len(target) :]
        return value

    def localise(value: str, volumes: list[tuple[str, str]]) -> str:
        if value != (mapped := local_path(value, volumes)):
            return mapped
        parts = []
        for part in value.split(","):
            host, sep, port = part.rpartition(":")
            if sep and (host in names or host == "0.0.0.0"):
                part = f"{LOOPBACK}:{port}"
            elif part in names or part == "0.0.0.0":
                part = LOOPBACK
            parts.append(part)
        return ",".join(parts)

    plan = []
    for spec in specs:
        argv = [local_path(arg, spec.volumes) for arg in spec.command]
        if argv and argv[0] == "omnistage":
            argv = [sys.executable, "-m", "omni_common.cli", *argv[1:]]
        environment = {k: localise(v, spec.volumes) for k, v in spec.environment.items()}
        plan.append(LocalProcess(spec.name, argv, environment, spec.health_address))
    return plan


class LocalCluster:
    """Starts a plan's processes, waits for health, stops them all (SIGTERM, then SIGKILL)."""

    def __init__(self, plan: list[LocalProcess], log_dir: Path | None = None) -> None:
        self.plan = plan
        self.log_dir = log_dir
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout_s: float = 180.0) -> None:
        try:
            for proc in self.plan:
                self._spawn(proc)
                self.wait_healthy(proc, timeout_s)
        except BaseException:
            self.stop()
            raise

    def _spawn(self, proc: LocalProcess) -> None:
        env = {**os.environ, **proc.environment, "PYTHONUNBUFFERED": "1"}
        out = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{proc.name}.log", "wb")  # noqa: SIM115 (lives with the process)
        self.processes[proc.name] = subprocess.Popen(
            proc.argv,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,
        )

    def wait_healthy(self, proc: LocalProcess, timeout_s: float) -> None:
        from omni_common.health import check_health

        deadline = time.monotonic() + timeout_s
        popen = self.processes[proc.name]
        while not check_health(proc.health_address, timeout_s=1.0):
            if popen.poll() is not None:
                raise Unavailable(f"{proc.name} exited with status {popen.returncode} while starting")
            if time.monotonic() > deadline:
                raise Unavailable(f"{proc.name} not healthy after {timeout_s:g} s")
            time.sleep(0.2)

    def stop(self, grace_s: float = 40.0) -> None:
        """SIGTERM in reverse start order; SIGKILL whatever outlives the grace period."""
        for popen in reversed(list(self.processes.values())):
            if popen.poll() is None:
                popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for popen in self.processes.values():
            try:
                popen.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait()
        self.processes.clear()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def loopback_plan(
    model_dir: Path, dtype: str = "float32", extra_env: dict[str, str] | None = None
) -> list[LocalProcess]:
    """Three stage processes and a coordinator on free loopback ports (tests, benchmarks)."""
    cli = [sys.executable, "-m", "omni_common.cli", "serve"]
    stages = {name: free_port() for name in ("ar-encoder", "dit-denoise", "vae-decode")}
    common = dict(extra_env or {})
    plan = [
        LocalProcess(
            stage,
            [*cli, stage],
            {
                **common,
                "OMNISTAGE_MODEL": str(model_dir),
                "OMNISTAGE_PORT": str(port),
                "OMNISTAGE_DTYPE": dtype,
            },
            f"{LOOPBACK}:{port}",
        )
        for stage, port in stages.items()
    ]
    port = free_port()
    env = {f"OMNISTAGE_{s.replace('-', '_').upper()}": f"{LOOPBACK}:{p}" for s, p in stages.items()}
    plan.append(
        LocalProcess(
            "coordinator",
            [*cli, "coordinator"],
            {**common, **env, "OMNISTAGE_PORT": str(port)},
            f"{LOOPBACK}:{port}",
        )
    )
    return plan
