"""Health probe of any omnistage service, used by the launcher and compose: grpc.health.v1
for the gRPC services, GET of an http(s):// URL (200 = healthy) for the HTTP gateway."""

from __future__ import annotations

import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omni_common.net.rpc import sync_channel
from omni_common.net.tls import TlsSettings, client_settings, https_context


def check_health(address: str, timeout_s: float = 2.0, tls: TlsSettings | None = None) -> bool:
    """True when the service at `address` ("host:port", or an http(s):// URL) answers SERVING
    (gRPC over TLS as `tls` says; default: this process's OMNISTAGE_TLS_CA)."""
    if address.startswith(("http://", "https://")):
        context = https_context(tls or client_settings()) if address.startswith("https://") else None
        try:
            with urllib.request.urlopen(address, timeout=timeout_s, context=context) as response:
                return bool(response.status == 200)
        except (OSError, urllib.error.URLError):
            return False
    with sync_channel(address, tls=tls) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
    return bool(response.status == health_pb2.HealthCheckResponse.SERVING)
