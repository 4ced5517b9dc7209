"""Bad input, shaped like `google.rpc.BadRequest`: `FieldViolation`s and the `ValidationError` carrying them.

Both services use these: the request contract (shared_runtime/contract.py) reports what is wrong with a
request as `FieldViolation`s, the frontend raises them to its clients as one `ValidationError`, and the
engine turns them into the message of its INVALID_ARGUMENT error output.

A violation's `field` is a dot path. The contract reports bare names (`top_p`, `logit_bias`); the
frontend prefixes them with where they sit in the public proto `tandem.v1.GenerateRequest`
(`sampling_params.top_p`), so the gRPC server turns them into `BadRequest.field_violations` without
translation, and the OpenAI layer maps them back to its own names.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class FieldViolation:
    """One bad field: its dot path and a human-readable reason."""

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
        super().__init__(describe(self.violations))

    @classmethod
    def single(cls, field: str, description: str) -> ValidationError:
        return cls([FieldViolation(field, description)])

    @property
    def fields(self) -> list[str]:
        """The field paths, in the order they were found."""
        return [v.field for v in self.violations]


def describe(violations: Iterable[FieldViolation]) -> str:
    """`field: description; ...` - one line naming every violation."""
    return "; ".join(f"{v.field}: {v.description}" for v in violations)
