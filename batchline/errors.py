"""Domain errors and the tables that map them to gRPC status codes and HTTP statuses.

Every rejection a client sees is raised as one of these, with a message a
person can act on; the gRPC servicer translates them with `grpc_status()`, the
REST port with `http_status()`, and nothing else decides status codes.
"""
from __future__ import annotations

import grpc

# Trailing metadata that carries an error's retry_after_s to the client, in whole milliseconds.
RETRY_AFTER_KEY = "retry-after-ms"


def duration_text(seconds: float) -> str:
    """A duration as messages quote it: 850 µs, 2.5 ms, 200 ms."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    ms = seconds * 1e3
    return f"{ms:.1f} ms" if ms < 10 else f"{ms:.0f} ms"


class BatchlineError(Exception):
    """Base of every error that becomes a gRPC status.

    `retry_after_s`, when set, tells the client when trying again could
    succeed (sent as RETRY_AFTER_KEY trailing metadata).
    """

    def __init__(self, message: str = "", retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class InvalidArgument(BatchlineError):
    """The request itself is wrong: names, datatypes, shapes, sizes, values."""


class NotFound(BatchlineError):
    """The model or version is not served by any live executor."""


class ResourceExhausted(BatchlineError):
    """The request is too large or the queue is full."""


class DeadlineExceeded(BatchlineError):
    """The latency budget ran out (or cannot be met) before an answer."""


class Unavailable(BatchlineError):
    """A dependency (Redis, every executor of the model) cannot be reached."""


class Internal(BatchlineError):
    """A bug or an unexpected runtime failure."""


class Unauthenticated(BatchlineError):
    """No token, or one the gateway does not know (batchline.auth)."""


class PermissionDenied(BatchlineError):
    """The token may not do this: a model outside its scope, or an admin call without admin rights."""


class AlreadyExists(BatchlineError):
    """What the call would create exists already (a shared-memory region's name)."""


class Unimplemented(BatchlineError):
    """A part of Triton's protocol batchline does not serve (CUDA shared memory)."""


_CODES: dict[type[BatchlineError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    Internal: grpc.StatusCode.INTERNAL,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    Unimplemented: grpc.StatusCode.UNIMPLEMENTED,
}
# As Triton's and KServe's HTTP endpoints answer: the client's fault 400 (a missing model 404),
# refusals that may pass later 429 (with Retry-After) or 503, a budget run out 504.
_HTTP: dict[type[BatchlineError], int] = {
    InvalidArgument: 400,
    NotFound: 404,
    ResourceExhausted: 429,
    DeadlineExceeded: 504,
    Unavailable: 503,
    Internal: 500,
    Unauthenticated: 401,
    PermissionDenied: 403,
    AlreadyExists: 409,
    Unimplemented: 501,
}
_ERRORS_BY_CODE: dict[int, type[BatchlineError]] = {c.value[0]: e for e, c in _CODES.items()}


def grpc_status(error: BaseException) -> grpc.StatusCode:
    for cls in type(error).__mro__:
        if cls in _CODES:
            return _CODES[cls]
    return grpc.StatusCode.INTERNAL


def http_status(error: BaseException) -> int:
    for cls in type(error).__mro__:
        if cls in _HTTP:
            return _HTTP[cls]
    return 500


def status_value(error: BaseException) -> int:
    """The numeric gRPC code, as carried in a Reply through Redis."""
    return grpc_status(error).value[0]


def from_status_value(code: int, message: str) -> BatchlineError:
    return _ERRORS_BY_CODE.get(code, Internal)(message)
