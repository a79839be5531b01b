"""TLS on every hop: who serves it, who verifies it, where the files are.

Every process reads its settings from the environment, one file path each, so the same
variables configure docker-compose, Kubernetes (Secrets mounted as files) and local processes:
- OMNISTAGE_TLS_CERT / OMNISTAGE_TLS_KEY: this service's certificate chain and private key
  (PEM). With both set, its gRPC port serves TLS only.
- OMNISTAGE_TLS_CA: the CA bundle (PEM) that every channel this process opens verifies its
  peer against: stage to stage, stage to coordinator, SDK and CLI to coordinator. With it
  unset, channels are plaintext.
- OMNISTAGE_TLS_SERVER_NAME: the name checked in a peer's certificate instead of the host of
  the address dialled. Replicas register by IP (a pod's, a container's), which no certificate
  can list ahead of time; `omnistage certs` puts CLUSTER_NAME in every certificate it makes, so
  the deployments set this to it.

Plaintext stays possible where nobody else can listen: a service bound to a loopback address
serves it and says so in its log line; bound to any other address it refuses to start without
TLS unless OMNISTAGE_ALLOW_PLAINTEXT=1 says a private network is trusted. Key material is
never logged; errors name the variable, not the file's content.
"""

from __future__ import annotations

import ipaddress
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

CLUSTER_NAME = "omnistage.cluster"  # in every certificate `omnistage certs` makes


@dataclass(frozen=True)
class TlsSettings:
    """One process's TLS material (PEM bytes; None where not configured)."""

    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None
    server_name: str = ""

    @property
    def serves_tls(self) -> bool:
        return self.cert is not None and self.key is not None

    @property
    def verifies_peers(self) -> bool:
        return self.ca is not None


def _read(name: str) -> bytes | None:
    path = os.environ.get(f"OMNISTAGE_{name}", "")
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise SystemExit(f"OMNISTAGE_{name} names a file that cannot be read ({err.strerror})") from None


def tls_settings() -> TlsSettings:
    """This process's TLS settings, from the environment (read at each call: tests and the
    SDK may set them late)."""
    cert, key = _read("TLS_CERT"), _read("TLS_KEY")
    if (cert is None) != (key is None):
        raise SystemExit("OMNISTAGE_TLS_CERT and OMNISTAGE_TLS_KEY must be set together")
    return TlsSettings(cert, key, _read("TLS_CA"), os.environ.get("OMNISTAGE_TLS_SERVER_NAME", ""))


def client_settings(ca_cert: str | Path | None = None, server_name: str = "") -> TlsSettings:
    """What a client (SDK, CLI) verifies: `ca_cert` when given, else OMNISTAGE_TLS_CA."""
    ca = Path(ca_cert).read_bytes() if ca_cert else _read("TLS_CA")
    return TlsSettings(ca=ca, server_name=server_name or os.environ.get("OMNISTAGE_TLS_SERVER_NAME", ""))


def channel_credentials(settings: TlsSettings) -> grpc.ChannelCredentials | None:
    """Credentials for a channel that verifies its peer, or None for plaintext."""
    if settings.ca is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=settings.ca)


def channel_name_options(settings: TlsSettings) -> list[tuple[str, str]]:
    """The option that makes a channel check `server_name` in the peer's certificate."""
    if settings.ca is None or not settings.server_name:
        return []
    return [("grpc.ssl_target_name_override", settings.server_name)]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def plaintext_allowed(address: str, name: str) -> str:
    """What a service's log line says about serving plaintext on `address`; SystemExit where it
    may not: off loopback without OMNISTAGE_ALLOW_PLAINTEXT=1."""
    host = address.rsplit(":", 1)[0]
    if is_loopback(host):
        return "PLAINTEXT (loopback only; set OMNISTAGE_TLS_CERT/KEY for TLS)"
    if os.environ.get("OMNISTAGE_ALLOW_PLAINTEXT", "") in ("1", "true", "yes"):
        return "PLAINTEXT (OMNISTAGE_ALLOW_PLAINTEXT; set OMNISTAGE_TLS_CERT/KEY for TLS)"
    raise SystemExit(
        f"{name}: refusing plaintext on {address}, which others on the network can reach: set "
        "OMNISTAGE_TLS_CERT and OMNISTAGE_TLS_KEY (`omnistage certs DIR` makes them), or "
        "OMNISTAGE_ALLOW_PLAINTEXT=1 on a network you trust"
    )


def bind(server: grpc.aio.Server, address: str, name: str, settings: TlsSettings) -> tuple[int, str]:
    """Bind `server` to `address` with TLS when this process has a certificate; plaintext on
    loopback, or elsewhere only when OMNISTAGE_ALLOW_PLAINTEXT=1. Returns the port and what the
    service's log line says about it."""
    if settings.serves_tls:
        assert settings.cert is not None and settings.key is not None
        credentials = grpc.ssl_server_credentials([(settings.key, settings.cert)])
        return server.add_secure_port(address, credentials), "TLS"
    said = plaintext_allowed(address, name)
    return server.add_insecure_port(address), said


def https_context(settings: TlsSettings) -> ssl.SSLContext | None:
    """A client context that verifies an HTTPS server against `settings.ca`; None without one."""
    if settings.ca is None:
        return None
    return ssl.create_default_context(cadata=settings.ca.decode())
