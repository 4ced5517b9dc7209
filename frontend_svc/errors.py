"""The errors a request can end with, independent of the API that carries them.

- `ValidationError`: bad client input, shaped like `google.rpc.BadRequest`.
- `ServiceError`: the request could not be served (draining, overloaded, no engine, the engine failed
  it); `code` is a gRPC status code number, so each API maps it once (gRPC status, HTTP status).

A `ValidationError` carries one or more `FieldViolation`s. Each violation's `field` is the dot path of
the offending field in the public proto `tandem.v1.GenerateRequest` (e.g. `text`, `token_ids.ids`,
`chat.messages`, `sampling_params.top_p`), so the gRPC server can turn it into
`BadRequest.field_violations` without translation.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class FieldViolation:
    """One bad field: its dot path in the public proto and a human-readable reason."""

    field: str
    description: str

    def with_prefix(self, prefix: str) -> FieldViolation:
        """The same violation with `prefix.` prepended to its field path."""
        return FieldViolation(f"{prefix}.{self.field}", self.description)


class ValidationError(ValueError):
    """Bad client input. Invariant: `violations` is never empty."""

    def __init__(self, violations: Iterable[FieldViolation]) -> None:
        self.violations: list[FieldViolation] = list(violations)
        if not self.violations:
            raise ValueError("ValidationError needs at least one violation")
        super().__init__("; ".join(f"{v.field}: {v.description}" for v in self.violations))

    @classmethod
    def single(cls, field: str, description: str) -> ValidationError:
        return cls([FieldViolation(field, description)])

    @property
    def fields(self) -> list[str]:
        """The field paths, in the order they were found."""
        return [v.field for v in self.violations]


# gRPC status code numbers (grpc.StatusCode values), spelled out so this module needs no grpc.
INTERNAL = 13
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
