"""`SamplingParams`: how to sample one request, with vLLM's field names and defaults.

The frontend owns the text-level parts (`stop`, `include_stop_str_in_output`, `n`,
`skip_special_tokens`); everything else is passed to the engine through `engine_fields()`, whose keys
are exactly those of `engine_svc.protocol.EngineSamplingParams`.

Invariant: a constructed `SamplingParams` has passed `validate()`, `stop` is a list of at most
`MAX_STOP_STRINGS` non-empty strings of at most `MAX_STOP_STRING_CHARS` characters, and
`stop_token_ids` a list of at most `MAX_STOP_TOKEN_IDS` non-negative ints.

Stop limits (like TGI's `--max-stop-sequences`, but roomier): 16 stop strings of up to 1024 characters
each, and up to 1024 stop token ids. The stop-string checker is linear in their total length, and the
text held back while a stop string might still match is shorter than the longest one; the engine scans
the stop ids for every sampled token. Field paths in the `ValidationError` are the
bare field names (`top_p`); callers serving the public proto prefix them with `sampling_params.`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

from frontend_svc.errors import FieldViolation, ValidationError

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
_UINT64_LIMIT = 1 << 64
INT32_MAX = (1 << 31) - 1  # the engine contract's integer fields (top_k, min_tokens, token ids) fit int32


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None = fill the context window
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top-N logprobs per generated token (0 = only the sampled one)
    prompt_logprobs: int | None = None
    n: int = 1
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        self.validate()

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as a list (it always is one after construction; this keeps type checkers happy)."""
        stop = self.stop
        return [stop] if isinstance(stop, str) else list(stop or [])

    def validate(self) -> None:
        """Raise `ValidationError` listing every bad field (bare names, e.g. `top_p`)."""
        violations = self.violations()
        if violations:
            raise ValidationError(violations)

    def violations(self) -> list[FieldViolation]:
        """Every problem with these params; empty when they are valid."""
        bad: list[FieldViolation] = []

        def add(name: str, description: str) -> None:
            bad.append(FieldViolation(name, description))

        if not _is_finite(self.temperature) or self.temperature < 0:
            add("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not _is_finite(self.top_p) or not 0 < self.top_p <= 1:
            add("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= INT32_MAX:
            add("top_k", f"must be -1, 0 (disabled) or a positive integer below 2**31, got {self.top_k!r}")
        if not _is_finite(self.min_p) or not 0 <= self.min_p <= 1:
            add("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < _UINT64_LIMIT):
            add("seed", f"must be an integer in [0, 2**64), got {self.seed!r}")
        max_ok = self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1)
        if not max_ok:
            add("max_tokens", f"must be at least 1, got {self.max_tokens!r}")
        self._check_min_tokens(add, max_ok)
        self._check_stops(add)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_finite(value) or not -2 <= value <= 2:
                add(name, f"must be in [-2, 2], got {value!r}")
        if not _is_finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            add("repetition_penalty", f"must be a finite number > 0, got {self.repetition_penalty!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                add(name, f"must be in [0, {MAX_LOGPROBS}], got {value!r}")
        if not _is_int(self.n) or self.n < 1:
            add("n", f"must be at least 1, got {self.n!r}")
        return bad

    def _check_min_tokens(self, add: Any, max_ok: bool) -> None:
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= INT32_MAX:
            add("min_tokens", f"must be in [0, 2**31), got {self.min_tokens!r}")
        elif max_ok and self.max_tokens is not None and self.min_tokens > self.max_tokens:
            add("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")

    def _check_stops(self, add: Any) -> None:
        stops = self.stop_strings
        if len(stops) > MAX_STOP_STRINGS:
            add("stop", f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
        elif not all(isinstance(s, str) for s in stops):
            add("stop", "every stop string must be a string")
        elif any(s == "" for s in stops):
            add("stop", "stop strings must not be empty")
        elif any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
            add("stop", f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters, "
                        f"got {max(len(s) for s in stops)}")
        stop_ids = self.stop_token_ids or []
        if len(stop_ids) > MAX_STOP_TOKEN_IDS:
            add("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop token ids are allowed, got {len(stop_ids)}")
        elif not all(_is_int(t) and 0 <= t <= INT32_MAX for t in stop_ids):
            add("stop_token_ids", "stop token ids must be integers in [0, 2**31)")

    def engine_fields(self) -> dict[str, Any]:
        """The token-level params, keyed like `engine_svc.protocol.EngineSamplingParams`."""
        return {
            "temperature": float(self.temperature),
            "top_p": float(self.top_p),
            "top_k": max(int(self.top_k), 0),
            "min_p": float(self.min_p),
            "seed": self.seed,
            "max_tokens": self.max_tokens,
            "min_tokens": self.min_tokens,
            "stop_token_ids": list(self.stop_token_ids or []),
            "ignore_eos": bool(self.ignore_eos),
            "presence_penalty": float(self.presence_penalty),
            "frequency_penalty": float(self.frequency_penalty),
            "repetition_penalty": float(self.repetition_penalty),
            "logprobs": self.logprobs,
            "prompt_logprobs": self.prompt_logprobs,
        }


def _is_int(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
