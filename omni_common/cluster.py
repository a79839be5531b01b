"""Local processes for a plan (omni_common/compose.py reads one from docker-compose.yml, or
`loopback_plan` makes one): started in order, each waited for until healthy, stopped
together (SIGTERM, then SIGKILL) with every child they made. `omnistage cluster up`, the
end-to-end tests and the benchmarks run the cluster this way. A launcher killed outright (no
`stop`) leaves nothing running: each service is started with its launcher's pid
(--parent-pid) and drains, as on SIGTERM, once that process is gone.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import ClassVar

from omni_common.compose import LOOPBACK, LocalProcess
from omni_common.errors import Unavailable
from omni_common.net.tls import TlsSettings
from omni_common.stages import STAGES

TLS_FILES = ("OMNISTAGE_TLS_CA", "OMNISTAGE_TLS_CERT", "OMNISTAGE_TLS_KEY")


class LocalCluster:
    """Starts a plan's processes, waits for health, stops them all (SIGTERM, then SIGKILL)."""

    # Every process any LocalCluster of this interpreter started, their children included
    # (a replica's device workers): what the tests' shared-memory leak checks call their own,
    # so that another omnistage on the host never fails them.
    started: ClassVar[set[int]] = set()

    def __init__(
        self, plan: list[LocalProcess], log_dir: Path | None = None, start_timeout_s: float = 180.0
    ) -> None:
        self.plan = plan
        self.log_dir = log_dir
        self.start_timeout_s = start_timeout_s
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.token_file: Path | None = None  # the cluster token this launcher made, if any
        self.pids: set[int] = set()  # this cluster's processes and their children, dead ones too

    def __enter__(self) -> LocalCluster:
        self.start(self.start_timeout_s)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def coordinator(self) -> str:
        """The coordinator's address."""
        return next(p.health_address for p in self.plan if p.name == "coordinator")

    @property
    def gateway(self) -> str:
        """The HTTP gateway's base URL ("" without one)."""
        health = next((p.health_address for p in self.plan if p.name == "gateway"), "")
        return health.rsplit("/", 1)[0] if health else ""

    def start(self, timeout_s: float = 180.0) -> None:
        """Start every process at once (stages load and compile side by side; each registers
        with the coordinator whenever it is up), wait until each is healthy, then until the
        coordinator routes to every stage replica of the plan."""
        try:
            self._make_token()
            self._make_certs()
            for proc in self.plan:
                self._spawn(proc)
            for proc in self.plan:
                self.wait_healthy(proc, timeout_s)
            self.wait_registered(timeout_s)
            self._note_children()  # device workers start with their replica, before it is healthy
        except BaseException:
            self.stop()
            raise

    def wait_registered(self, timeout_s: float) -> None:
        from omni_common.client import Client

        expected: dict[str, int] = {}
        for proc in self.plan:
            stage = proc.argv[-1] if "serve" in proc.argv else ""
            if stage in STAGES:
                expected[stage] = expected.get(stage, 0) + 1
        if not expected or not any(p.name == "coordinator" for p in self.plan):
            return
        deadline = time.monotonic() + timeout_s
        env = next(p for p in self.plan if p.name == "coordinator").environment
        ca, name = env.get("OMNISTAGE_TLS_CA") or None, env.get("OMNISTAGE_TLS_SERVER_NAME", "")
        with Client(self.coordinator, ca_cert=ca, server_name=name) as client:
            while True:
                try:
                    models = client.list_models()
                except Exception:
                    models = []
                if any(all(m.replicas.get(s, 0) >= n for s, n in expected.items()) for m in models):
                    return
                if time.monotonic() > deadline:
                    routed = {m.name: dict(m.replicas) for m in models}
                    raise Unavailable(
                        f"the coordinator does not route to every replica after {timeout_s:g} s: "
                        f"expected {expected}, routes to {routed}{self.log_tails()}"
                    )
                time.sleep(0.1)

    def _cause(self, name: str) -> str:
        """': ' and the last line `name` wrote (its log's), or where to look without a log."""
        if self.log_dir is None:
            return " (its output above says why)"
        path = self.log_dir / f"{name}.log"
        lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
        last = next((line.strip() for line in reversed(lines) if line.strip()), "")
        return f": {last[:300]} (log: {path})" if last else f" (log: {path})"

    def log_tails(self, lines: int = 15) -> str:
        """The last lines of every process's log, for an error that says why a start failed."""
        if self.log_dir is None:
            return ""
        tails = []
        for name in self.processes:
            path = self.log_dir / f"{name}.log"
            if path.is_file():
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                tails.append(f"--- {name} ---\n" + "\n".join(tail))
        return "\n" + "\n".join(tails)

    def add(self, proc: LocalProcess, timeout_s: float = 180.0) -> None:
        """Start one more process (a new replica) and wait until it is healthy."""
        self.plan.append(proc)
        self._spawn(proc)
        self.wait_healthy(proc, timeout_s)
        self._note_children()

    def _note_children(self) -> None:
        """Add the live descendants of this cluster's processes to `pids` (and `started`)."""
        self.pids |= descendants(self.pids)
        LocalCluster.started.update(self.pids)

    def _make_token(self) -> None:
        """Internal RPCs of a local cluster need a token too (omni_common.net.auth): a
        token file the plan names (docker-compose.yml's) is made if missing and kept; with
        none named anywhere, a random one in an owner-only temporary file, removed at stop."""
        named = {p.environment.get("OMNISTAGE_CLUSTER_TOKEN_FILE", "") for p in self.plan} - {""}
        for path in map(Path, named):
            if not path.exists():
                path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                _write_token(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        names = ("OMNISTAGE_CLUSTER_TOKEN", "OMNISTAGE_CLUSTER_TOKEN_FILE")
        if named or any(os.environ.get(n) or any(p.environment.get(n) for p in self.plan) for n in names):
            return
        fd, path_text = tempfile.mkstemp(prefix="omnistage-cluster-token-")  # mode 0600
        _write_token(fd)
        self.token_file = Path(path_text)

    @staticmethod
    def client_tls(proc: LocalProcess) -> TlsSettings:
        """How a client of `proc` verifies it: as `proc`'s own peers do (its environment)."""
        ca = proc.environment.get("OMNISTAGE_TLS_CA") or os.environ.get("OMNISTAGE_TLS_CA", "")
        name = proc.environment.get("OMNISTAGE_TLS_SERVER_NAME", "")
        return TlsSettings(ca=Path(ca).read_bytes() if ca else None, server_name=name)

    def _make_certs(self) -> None:
        """TLS files the plan names (docker-compose.yml's) are made if missing, as
        `omnistage certs` would: a local CA and one certificate per service, kept."""
        for path in {Path(p.environment[n]) for p in self.plan for n in TLS_FILES if p.environment.get(n)}:
            if not path.exists():
                from omni_common.certs import SERVICES, make_certs

                make_certs(path.parent, SERVICES)

    def _spawn(self, proc: LocalProcess) -> None:
        # Each service stops once this process is gone (runtime/serve.py: stop_with_parent).
        env = {
            **os.environ,
            **proc.environment,
            "PYTHONUNBUFFERED": "1",
            "OMNISTAGE_PARENT_PID": str(os.getpid()),
        }
        if self.token_file is not None:
            env["OMNISTAGE_CLUSTER_TOKEN_FILE"] = str(self.token_file)
        if "OMNISTAGE_THREADS" not in env and is_stage(proc):
            # Stage processes on one host share its cores: torch in each taking all of them
            # oversubscribes the CPU as soon as stages overlap (measured on 2 cores, 64x64,
            # 8 concurrent requests: 4.8 images/s with 2 threads per stage, 26 with 1).
            stages = sum(is_stage(p) for p in self.plan)
            env["OMNISTAGE_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(stages, 1)))
        out = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{proc.name}.log", "wb")  # noqa: SIM115 (lives with the process)
        self.processes[proc.name] = subprocess.Popen(
            proc.argv,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,  # its own process group: what `stop` kills at the end of the grace
        )
        self.pids.add(self.processes[proc.name].pid)
        LocalCluster.started.add(self.processes[proc.name].pid)

    def wait_healthy(self, proc: LocalProcess, timeout_s: float) -> None:
        from omni_common.health import check_health

        deadline = time.monotonic() + timeout_s
        popen = self.processes[proc.name]
        while not check_health(proc.health_address, timeout_s=1.0, tls=self.client_tls(proc)):
            # The first line names the service and the cause (a failed service's last line is
            # its one-line error, `omnistage serve`'s); the log tails below it are for tests.
            if popen.poll() is not None:
                raise Unavailable(
                    f"{proc.name} exited with status {popen.returncode} while starting"
                    f"{self._cause(proc.name)}{self.log_tails()}"
                )
            if time.monotonic() > deadline:
                cause = self._cause(proc.name)
                raise Unavailable(f"{proc.name} not healthy after {timeout_s:g} s{cause}{self.log_tails()}")
            time.sleep(0.2)

    def stop(self, grace_s: float = 40.0) -> None:
        """SIGTERM in reverse start order; SIGKILL whatever outlives the grace period, with
        every process it started (its process group: a replica's device workers)."""
        self._note_children()
        for popen in reversed(list(self.processes.values())):
            if popen.poll() is None:
                popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for popen in self.processes.values():
            try:
                popen.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(popen.pid, signal.SIGKILL)  # the process and every one it started
                popen.wait()
        self.processes.clear()
        if self.token_file is not None:
            self.token_file.unlink(missing_ok=True)
            self.token_file = None


def descendants(roots: set[int]) -> set[int]:
    """The live processes below `roots` (children, grandchildren, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_bytes()
        except OSError:
            continue  # exited meanwhile
        parent = int(stat[stat.rindex(b")") + 2 :].split()[1])  # the field after the state
        children.setdefault(parent, []).append(int(entry.name))
    found: set[int] = set()
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _write_token(fd: int) -> None:
    with os.fdopen(fd, "w") as file:
        file.write(secrets.token_urlsafe(32) + "\n")


def is_stage(proc: LocalProcess) -> bool:
    return "serve" in proc.argv and proc.argv[-1] in STAGES


_PORTS_GIVEN: set[int] = set()
_PORTS_LOCK = threading.Lock()


def free_port() -> int:
    """A loopback port that nothing listens on now and that this process has not handed out
    before. The probe socket closes at once, so the system may offer the same port to the next
    probe before whoever took the first binds it. A cluster's coordinator and one of its stages
    were once both given one port, and the stage failed to start."""
    with _PORTS_LOCK:
        while (port := _probe_port()) in _PORTS_GIVEN:
            pass
        _PORTS_GIVEN.add(port)
        return port


def _probe_port() -> int:
    """A port the system offers for a loopback socket bound to port 0."""
    import socket

    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def loopback_plan(
    model_dir: Path,
    dtype: str = "float32",
    extra_env: dict[str, str] | None = None,
    replicas: dict[str, int] | None = None,
) -> list[LocalProcess]:
    """A coordinator, then stage replicas that register with it, on free loopback ports
    (tests, benchmarks). `replicas` sets a stage's count (default 1 each)."""
    cli = [sys.executable, "-m", "omnistage_cli", "serve"]
    common = dict(extra_env or {})
    port = free_port()
    coordinator = f"{LOOPBACK}:{port}"
    plan = [
        LocalProcess(
            "coordinator", [*cli, "coordinator"], {**common, "OMNISTAGE_PORT": str(port)}, coordinator
        )
    ]
    for stage in STAGES:
        for i in range((replicas or {}).get(stage, 1)):
            plan.append(
                stage_process(
                    stage,
                    model_dir,
                    coordinator,
                    f"{stage}-{i + 1}" if i else stage,
                    {
                        **common,
                        "OMNISTAGE_DTYPE": dtype,
                    },
                )
            )
    return plan


def stage_process(
    stage: str, model_dir: Path, coordinator: str, name: str = "", extra_env: dict[str, str] | None = None
) -> LocalProcess:
    """One stage replica on a free loopback port, registering with `coordinator`."""
    port = free_port()
    env = {
        **(extra_env or {}),
        "OMNISTAGE_MODEL": str(model_dir),
        "OMNISTAGE_PORT": str(port),
        "OMNISTAGE_COORDINATOR": coordinator,
    }
    cli = [sys.executable, "-m", "omnistage_cli", "serve", stage]
    return LocalProcess(name or stage, cli, env, f"{LOOPBACK}:{port}")
