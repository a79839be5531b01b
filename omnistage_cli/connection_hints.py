"""What the command line adds to an error a person meets first: a plaintext client against a
TLS cluster sees only `UNAVAILABLE: Socket closed`, which says nothing of certificates."""

from __future__ import annotations

import os
import re

import grpc

# What gRPC says when a plaintext client talks to a TLS server (or the handshake fails).
_TLS_SYMPTOMS = re.compile(r"socket closed|handshake|ssl|tls|connection reset", re.IGNORECASE)
CLUSTER_CA = ".secrets/tls/ca.pem"  # what `omnistage cluster up` and docker-compose.yml use


def tls_hint(code: grpc.StatusCode, message: str, ca_cert: str) -> str:
    """A sentence to add to an UNAVAILABLE that looks like a TLS mismatch, "" otherwise."""
    if code != grpc.StatusCode.UNAVAILABLE or not _TLS_SYMPTOMS.search(message):
        return ""
    if ca_cert or os.environ.get("OMNISTAGE_TLS_CA"):
        return (
            " (the TLS handshake failed: check that the CA given by --ca-cert or OMNISTAGE_TLS_CA "
            "signed the server's certificate)"
        )
    return (
        " (the server may serve TLS, as `omnistage cluster up` does: pass "
        f"--ca-cert {CLUSTER_CA}, or set OMNISTAGE_TLS_CA)"
    )
