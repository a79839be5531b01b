"""Errors that carry a gRPC status: raised anywhere, turned into a status by the servers.

A message is written for a person and never holds a path, a key or a traceback.
"""

from __future__ import annotations

import grpc
import grpc.aio


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
    """Over capacity or over a size limit; `retry_after_ms` is a hint when waiting helps."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class Unavailable(OmniError):
    code = grpc.StatusCode.UNAVAILABLE


class Aborted(OmniError):
    code = grpc.StatusCode.ABORTED


class Unimplemented(OmniError):
    code = grpc.StatusCode.UNIMPLEMENTED


class DeadlineExceeded(OmniError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(OmniError):
    code = grpc.StatusCode.CANCELLED


class AlreadyExists(OmniError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(OmniError):
    code = grpc.StatusCode.FAILED_PRECONDITION


_BY_CODE: dict[grpc.StatusCode, type[OmniError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        PermissionDenied,
        ResourceExhausted,
        Unavailable,
        Aborted,
        Unimplemented,
        DeadlineExceeded,
        Cancelled,
        AlreadyExists,
        FailedPrecondition,
    )
}


async def abort(context: grpc.aio.ServicerContext, err: OmniError) -> None:
    """End a call with `err`'s status; a retry hint travels as `retry-after-ms` metadata."""
    retry_after_ms = getattr(err, "retry_after_ms", None)
    if retry_after_ms is not None:
        context.set_trailing_metadata((("retry-after-ms", str(retry_after_ms)),))
    await context.abort(err.code, err.message)


def error_for_status(code: grpc.StatusCode, message: str) -> OmniError:
    """The typed error for a gRPC status (OmniError itself for codes without a subclass)."""
    cls = _BY_CODE.get(code)
    return cls(message) if cls is not None else OmniError(message, code)


def error_from_rpc(err: grpc.RpcError) -> OmniError:
    """Turn a failed call (sync or asyncio) into the typed error of its status; a
    RESOURCE_EXHAUSTED keeps the server's `retry-after-ms` hint (see `abort`)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourceExhausted(details or code.name, retry_after_ms=_retry_after_ms(err))
    return error_for_status(code, details or code.name)


def _retry_after_ms(err: grpc.RpcError) -> int | None:
    trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == "retry-after-ms" and str(value).isdigit():
            return int(value)
    return None
