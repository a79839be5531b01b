"""Who may call what.

- Internal RPCs (Stage, StageControl, TensorStore, Registry) carry the cluster's shared secret
  in the `x-omnistage-cluster-token` metadata entry; with a secret configured, a call without
  it, or with another, is UNAUTHENTICATED. Every process of a cluster reads its secrets from
  OMNISTAGE_CLUSTER_TOKEN (comma-separated) or, better, the file OMNISTAGE_CLUSTER_TOKEN_FILE
  names, one a line (never from a flag: argv is visible to every user of the host): it sends
  the first and accepts any, so a token rotates without downtime (add the new one second
  everywhere, then first, then drop the old). Without one, internal RPCs are open and each
  service says so in its log line. `omnistage cluster up` makes a random one.
- The public Coordinator API takes API keys (`x-api-key`, or `authorization: Bearer KEY`):
  with keys configured (OMNISTAGE_API_KEYS, comma-separated, or OMNISTAGE_API_KEYS_FILE, one
  a line; several, so one can be rotated while the other still works), a call without a
  listed key is PERMISSION_DENIED.
- Health (grpc.health.v1) stays open: orchestrators probe it without secrets.
Secrets are compared in constant time and never logged or echoed in an error.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio

CLUSTER_TOKEN_HEADER = "x-omnistage-cluster-token"
API_KEY_HEADER = "x-api-key"
INTERNAL_SERVICES = frozenset(
    f"omnistage.v1.{name}" for name in ("Stage", "StageControl", "TensorStore", "Registry")
)
PUBLIC_SERVICES = frozenset({"omnistage.v1.Coordinator"})

Metadata = tuple[tuple[str, str], ...]


def _secrets(name: str) -> list[str]:
    """OMNISTAGE_<name> (comma-separated) or the lines of the file OMNISTAGE_<name>_FILE."""
    path = os.environ.get(f"OMNISTAGE_{name}_FILE", "")
    try:
        text = Path(path).read_text() if path else os.environ.get(f"OMNISTAGE_{name}", "")
    except OSError as err:
        raise SystemExit(f"OMNISTAGE_{name}_FILE names a file that cannot be read ({err.strerror})") from None
    return [s.strip() for s in text.replace(",", "\n").splitlines() if s.strip()]


def cluster_tokens() -> list[str]:
    """This process's cluster secrets: the one it sends first, then others it accepts."""
    return _secrets("CLUSTER_TOKEN")


def api_keys() -> list[str]:
    """The coordinator's accepted API keys; empty when the public API is open."""
    return _secrets("API_KEYS")


def cluster_metadata() -> Metadata:
    """What an internal call sends: the cluster secret, when there is one."""
    tokens = cluster_tokens()
    return ((CLUSTER_TOKEN_HEADER, tokens[0]),) if tokens else ()


def _matches(given: str | bytes | None, secrets: Sequence[str]) -> bool:
    if not isinstance(given, str):
        return False
    found = False
    for secret in secrets:  # every secret compared, in constant time each
        found |= hmac.compare_digest(given.encode(), secret.encode())
    return found


def _api_key(metadata: Mapping[str, str | bytes]) -> str | bytes | None:
    auth = metadata.get("authorization")
    if isinstance(auth, str) and auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return metadata.get(API_KEY_HEADER)


@dataclass(frozen=True)
class Caller:
    """Who a public call comes from, as far as the coordinator needs to know: the owner of
    the requests it starts (a fingerprint of its API key, never the key; "" when the public
    API is open, where every caller is one owner) and whether it is an operator (it also
    carries the cluster token, or the public API is open): only operators see replica
    addresses."""

    owner: str
    operator: bool


def caller(metadata: Mapping[str, str | bytes], keys: Sequence[str], tokens: Sequence[str]) -> Caller:
    """The Caller of a public call that passed AuthInterceptor (so its key, if keys are
    configured, is one of them)."""
    if not keys:
        return Caller(owner="", operator=True)
    key = _api_key(metadata)
    owner = hashlib.sha256(key.encode()).hexdigest()[:32] if isinstance(key, str) else ""
    operator = bool(tokens) and _matches(metadata.get(CLUSTER_TOKEN_HEADER), tokens)
    return Caller(owner=owner, operator=operator)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses internal calls without the cluster secret and public calls without an API key
    (each check only where its secret is configured)."""

    def __init__(self, tokens: Sequence[str], keys: Sequence[str]) -> None:
        self.tokens = list(tokens)
        self.keys = list(keys)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        service = details.method.strip("/").split("/")[0]
        metadata = dict(details.invocation_metadata or ())
        handler = await continuation(details)
        if service in INTERNAL_SERVICES and self.tokens:
            if not _matches(metadata.get(CLUSTER_TOKEN_HEADER), self.tokens):
                message = f"{details.method} is internal to the cluster and needs its token"
                return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED, message)
        elif service in PUBLIC_SERVICES and self.keys and not _matches(_api_key(metadata), self.keys):
            return _refusing(handler, grpc.StatusCode.PERMISSION_DENIED, "a valid API key is required")
        return handler


def _refusing(
    handler: grpc.RpcMethodHandler | None, code: grpc.StatusCode, message: str
) -> grpc.RpcMethodHandler:
    """A handler that ends the call with `code` without reading its request. The check above
    looks at the metadata only; a handler that took a request message would first make gRPC
    receive and buffer the whole body (up to MAX_MESSAGE_BYTES) from a caller that has shown
    no credential: sixteen 60 MiB calls without the token once cost a replica 2.6 GiB. So the
    refusal is request-streaming (the body is never pulled; gRPC drops it as the call ends)
    whatever the method's real shape; the wire does not tell the two apart."""

    async def refuse(requests: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    if handler is not None and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    return grpc.stream_unary_rpc_method_handler(refuse)


def describe(tokens: Sequence[str], keys: Sequence[str]) -> str:
    """What a service's log line says about its access control (never the secrets)."""
    internal = "internal RPCs need the cluster token" if tokens else "internal RPCs OPEN (no cluster token)"
    public = f"{len(keys)} API key(s)" if keys else "public API open"
    return f"{internal}; {public}"
