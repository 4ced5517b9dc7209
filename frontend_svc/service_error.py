"""Why a request could not be served, independent of the API that carries it: `ServiceError`.

`ServiceError`: the request could not be served (draining, overloaded, no engine, the engine failed
it); `code` is a gRPC status code number, so each API maps it once (gRPC status, HTTP status). Bad
client input is a `ValidationError` (shared_runtime/violations.py: the request contract reports it).
"""

from __future__ import annotations

# gRPC status code numbers (grpc.StatusCode values), spelled out so this module needs no grpc.
INTERNAL = 13
NOT_FOUND = 5
RESOURCE_EXHAUSTED = 8
UNAVAILABLE = 14


class ServiceError(Exception):
    """A request that cannot be served or did not finish.

    `code` is a gRPC status code number (UNAVAILABLE, RESOURCE_EXHAUSTED, or what the engine reported);
    `reason` is a stable machine-readable word (DRAINING, TOO_MANY_REQUESTS, NO_READY_ENGINE,
    ENGINE_UNAVAILABLE, ENGINE_ERROR) that clients may branch on.
    """

    def __init__(self, code: int, message: str, reason: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason
