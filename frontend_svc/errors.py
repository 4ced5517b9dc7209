"""Validation errors shaped like `google.rpc.BadRequest`.

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
