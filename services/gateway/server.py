"""The gateway's process: the ASGI app (app.py) on uvicorn, with the services' conventions
(omni_common.runtime.serve): bind (port 0 works), say "gateway ready on ...", and on
SIGTERM/SIGINT drain: /health turns 503, new generations get 503, open ones get
DRAIN_GRACE_S to finish, then the server stops."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Callable, Iterator

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from omni_common.net.tls import plaintext_allowed, tls_settings
from omni_common.runtime.config import DRAIN_GRACE_S, GatewayConfig
from omni_common.runtime.serve import run
from services.gateway.app import GatewayState, build_app

log = logging.getLogger("omnistage.gateway")

# Slow clients: a request's headers must arrive within HEADER_TIMEOUT_S of the connection (or
# of the previous response: uvicorn's keep-alive), its body within serving.BODY_TIMEOUT_S; at
# most MAX_CONNECTIONS connections are open at once (more get 503 and are closed).
HEADER_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 512


def header_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's HTTP/1.1 protocol with the first request's headers bounded in time too."""

    class HeaderTimeout(H11Protocol):
        # A timer from the connection (and from each response) to the next request's headers:
        # if the client is still sending them when it fires, the connection closes. uvicorn's
        # own keep-alive timer is disarmed by any byte, so a slow-loris client dripping a
        # header line at a time would hold the connection forever.
        headers_due: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self.headers_due is not None:
                self.headers_due.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self.headers_due is not None:
                self.headers_due.cancel()
            self.headers_due = self.loop.call_later(timeout_s, self._headers_late)

        def _headers_late(self) -> None:
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.timeout_keep_alive_handler()  # closes the connection

    return HeaderTimeout


class _Server(uvicorn.Server):
    """uvicorn's server without its own signal handlers (they stop at once): ours drain first."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind(address: str) -> socket.socket:
    """A listening TCP socket on "host:port" (port 0: any free one)."""
    host, port = address.rsplit(":", 1)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), int(port)))
    except OSError as err:
        sock.close()
        raise SystemExit(f"gateway: cannot bind {address}: {err.strerror}") from err
    sock.listen(1024)
    sock.setblocking(False)
    return sock


async def serve_gateway(
    config: GatewayConfig,
    *,
    ready: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
    grace_s: float = DRAIN_GRACE_S,
    header_timeout_s: float = HEADER_TIMEOUT_S,
    max_connections: int = MAX_CONNECTIONS,
) -> None:
    """Serve the gateway until a signal or `stop`; `ready(url)` once it accepts requests."""
    app = build_app(config)
    state: GatewayState = app.state.gateway
    # HTTPS with the service's certificate (omni_common.net.tls), as every gRPC port.
    tls = tls_settings()
    said = "TLS" if tls.serves_tls else plaintext_allowed(config.bind_address, "gateway")
    cert = os.environ["OMNISTAGE_TLS_CERT"] if tls.serves_tls else None
    key = os.environ["OMNISTAGE_TLS_KEY"] if tls.serves_tls else None
    sock = bind(config.bind_address)
    host, port = sock.getsockname()[:2]
    server = _Server(
        uvicorn.Config(
            app,
            log_config=None,  # the process's logging (setup_logging) stays
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=int(grace_s),
            ssl_certfile=cert,
            ssl_keyfile=key,
            http=header_timeout_protocol(header_timeout_s),
            limit_concurrency=max_connections,
        )
    )
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if serving.done():
            serving.result()  # the start-up error
            raise SystemExit("gateway: the server stopped while starting")
        await asyncio.sleep(0.01)
    url = f"{'https' if tls.serves_tls else 'http'}://{host}:{port}"
    log.info(
        "gateway listening on %s (pid %d), coordinator %s; %s", url, os.getpid(), config.coordinator, said
    )
    print(f"gateway ready on {host}:{port}", flush=True)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready(url)
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait([serving, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        log.info("gateway draining (grace %.0f s)", grace_s)
        state.draining = True
        deadline = loop.time() + grace_s
        while state.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        server.should_exit = True
        await asyncio.gather(serving, return_exceptions=True)
        sock.close()
        log.info("gateway stopped")


def main(config: GatewayConfig) -> None:
    run(serve_gateway(config))
