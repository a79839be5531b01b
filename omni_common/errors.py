"""Errors that carry a gRPC status: raised anywhere, turned into a status by the servers.

A message is written for a person and never holds a path, a key or a traceback.
"""

from __future__ import annotations

import grpc


class OmniError(Exception):
    """An error with the gRPC status code a caller should see."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class InvalidArgument(OmniError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(OmniError):
    code = grpc.StatusCode.NOT_FOUND


class PermissionDenied(OmniError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(OmniError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(OmniError):
    code = grpc.StatusCode.UNAVAILABLE


class Aborted(OmniError):
    code = grpc.StatusCode.ABORTED


class Unimplemented(OmniError):
    code = grpc.StatusCode.UNIMPLEMENTED
