"""Health probe of any omnistage service (grpc.health.v1), used by the launcher and compose."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omni_common.runtime.rpc import sync_channel
from omni_common.runtime.tls import TlsSettings


def check_health(address: str, timeout_s: float = 2.0, tls: TlsSettings | None = None) -> bool:
    """True when the service at `address` answers SERVING (over TLS as `tls` says; default:
    this process's OMNISTAGE_TLS_CA)."""
    with sync_channel(address, tls=tls) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
    return bool(response.status == health_pb2.HealthCheckResponse.SERVING)
