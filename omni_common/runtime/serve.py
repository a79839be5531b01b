"""The one process launcher for every service: event loop, gRPC server, health, signals.

SIGTERM/SIGINT drain the server: health turns NOT_SERVING, new calls are refused,
in-flight calls get `grace_s` to finish, then the service's own cleanup runs (leases
released, shared-memory segments unlinked). The optional metrics endpoint lives as long as
the gRPC server, so a drain can be watched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from omni_common.net.auth import AuthInterceptor, api_keys, cluster_tokens, describe
from omni_common.net.rpc import aio_server
from omni_common.net.tls import bind, tls_settings
from omni_common.runtime.config import DRAIN_GRACE_S
from omni_common.runtime.metrics import start_metrics_server

log = logging.getLogger("omnistage.serve")

Setup = Callable[[grpc.aio.Server, str], Awaitable[None]]


async def serve(
    name: str,
    bind_address: str,
    setup: Setup,
    *,
    on_drain: Callable[[], None] = lambda: None,
    is_idle: Callable[[], bool] = lambda: True,
    on_stop: Callable[[], None] = lambda: None,
    grace_s: float = DRAIN_GRACE_S,
    ready: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
    health_servicer: health.aio.HealthServicer | None = None,
    metrics: CollectorRegistry | None = None,
    metrics_port: int = 0,
) -> None:
    """Bind, call `setup(server, bound_address)`, serve until a signal or `stop` is set.

    Draining keeps the server up (so peers can still fetch and release this process's
    tensors) until `is_idle()` or `grace_s` has passed; then the server stops and
    `on_stop` frees what is left. The health service answers for "" (the process) and for
    whatever entries the service sets on `health_servicer`. `ready(address)` is called once
    the server accepts calls (tests bind port 0). With `metrics` and a `metrics_port`
    (0 = off), Prometheus can scrape http://host:metrics_port/metrics.
    """
    tokens, keys = cluster_tokens(), api_keys()
    server = aio_server(interceptors=(AuthInterceptor(tokens, keys),))
    served = _recording_services(server)
    health_servicer = health_servicer or health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port, transport_security = bind(server, bind_address, name, tls_settings())
    if port == 0:
        raise SystemExit(f"{name}: cannot bind {bind_address}")
    host = bind_address.rsplit(":", 1)[0]
    address = f"{host}:{port}"
    metrics_server = None
    if metrics is not None and metrics_port:
        try:
            metrics_server = await start_metrics_server(metrics, host, metrics_port)
        except OSError as err:
            reason = err.strerror or str(err)
            raise SystemExit(f"{name}: cannot serve metrics on {host}:{metrics_port}: {reason}") from err
        log.info("%s metrics at http://%s:%d/metrics", name, host, metrics_port)
    await setup(server, address)
    # grpcurl and friends list and call every service without the .proto files.
    reflection.enable_server_reflection((*served, reflection.SERVICE_NAME), server)
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    access = describe(tokens, keys)
    log.info("%s listening on %s (pid %d); %s; %s", name, address, os.getpid(), transport_security, access)
    print(f"{name} ready on {address}", flush=True)

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        # Only the main thread may install handlers; in-process test clusters use `stop`.
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready(address)
    try:
        await stop.wait()
    finally:
        log.info("%s draining (grace %.0f s)", name, grace_s)
        await health_servicer.enter_graceful_shutdown()
        on_drain()
        deadline = loop.time() + grace_s
        while not is_idle() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        await server.stop(1.0)
        if metrics_server is not None:
            metrics_server.close()
            await metrics_server.wait_closed()
        on_stop()
        log.info("%s stopped", name)


def _recording_services(server: grpc.aio.Server) -> list[str]:
    """The names of the services registered on `server` from now on (what reflection lists)."""
    names: list[str] = []
    register = server.add_registered_method_handlers

    def recording(service_name: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        names.append(service_name)
        register(service_name, handlers)

    server.add_registered_method_handlers = recording
    return names


# How often a service checks that its launcher is still its parent (stop_with_parent).
PARENT_POLL_S = 0.5


def stop_with_parent(parent_pid: int) -> None:
    """SIGTERM this process, the drain its launcher's own stop would start, once `parent_pid` is
    no longer its parent. A launcher killed outright (SIGKILL) cannot stop its children, and
    they would run on, reparented; a thread that polls, as a replica's device workers poll
    theirs (runtime/rank.py), works wherever the launcher started it from (PR_SET_PDEATHSIG
    fires when the launcher's starting *thread* ends, and on Linux only)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        log.warning("the launcher (pid %d) is gone: stopping", parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def run(main: Coroutine[Any, Any, None]) -> None:
    """Run `main` on uvloop (OMNISTAGE_LOOP=asyncio for the standard loop)."""
    if os.environ.get("OMNISTAGE_LOOP", "uvloop") == "uvloop":
        try:
            import uvloop

            uvloop.run(main)
            return
        except ImportError:
            log.warning("uvloop is not installed; using the standard asyncio loop")
    asyncio.run(main)


def advertised_address(bound: str, advertise_host: str = "") -> str:
    """The address peers reach a service at: `advertise_host` (or, bound to 0.0.0.0, this
    host's address as its peers see it: a container's IP on its network) with the bound port."""
    host, port = bound.rsplit(":", 1)
    if advertise_host:
        host = advertise_host
    elif host == "0.0.0.0":
        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            host = "127.0.0.1"
    return f"{host}:{port}"
