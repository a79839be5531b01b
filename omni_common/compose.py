"""The compose file read as a plan of local processes (`omnistage cluster up`, tests,
benchmarks).

The compose file is the single description of the cluster. A plan runs exactly its services,
commands and environments, with three translations for one host without Docker: a service
name used as a host and 0.0.0.0 become 127.0.0.1, a volume target becomes its source
directory, and the `omnistage` command runs from this interpreter.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

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
    replicas: int = 1


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
            replicas=int((body.get("deploy") or {}).get("replicas", 1)),
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


def local_plan(
    specs: list[ServiceSpec], compose_dir: Path, scale: dict[str, int] | None = None
) -> list[LocalProcess]:
    """The processes that run `specs` on this host; `scale` overrides a service's replica
    count. Replica i (from 0) of a service listens on its declared port + 100 * i."""
    scale = scale or {}
    unknown = set(scale) - {spec.name for spec in specs}
    if unknown:
        raise ValueError(f"--scale names no service of the compose file: {sorted(unknown)}")
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
            argv = [sys.executable, "-m", "omnistage_cli", *argv[1:]]
        environment = {k: localise(v, spec.volumes) for k, v in spec.environment.items()}
        for i in range(scale.get(spec.name, spec.replicas)):
            if i == 0:
                plan.append(LocalProcess(spec.name, argv, environment, spec.health_address))
                continue
            port, moved_address = _moved(spec.health_address, 100 * i)
            plan.append(
                LocalProcess(
                    f"{spec.name}-{i + 1}", argv, {**environment, "OMNISTAGE_PORT": port}, moved_address
                )
            )
    return plan


def _moved(health_address: str, by: int) -> tuple[str, str]:
    """The port of a health address ("host:port", or "http://host:port/path") moved by `by`,
    and the address with it."""
    scheme, sep, rest = health_address.rpartition("://")
    hostport, slash, path = rest.partition("/")
    host, port = hostport.rsplit(":", 1)
    moved = str(int(port) + by)
    return moved, f"{scheme}{sep}{host}:{moved}{slash}{path}"
