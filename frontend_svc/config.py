"""Frontend configuration: one frozen dataclass, validated at construction.

Every check raises `ConfigError` naming the flag and what to do about it. The model directory is read
only for its tokenizer files and `config.json` (vocabulary size, context window); the weights live on
the engines.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROUTING_POLICIES = ("least-load", "prefix")
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024


class ConfigError(ValueError):
    """A configuration value is invalid; the message says which and how to fix it."""


@dataclass(frozen=True)
class FrontendConfig:
    model: str
    engines: tuple[str, ...] = ("127.0.0.1:50051",)  # "host:port" or "dns:///name:port" entries
    host: str = "0.0.0.0"
    port: int = 50050  # 0 = any free port (tests)
    metrics_port: int = 9090  # reserved for Prometheus /metrics; 0 disables
    max_concurrent_requests: int = 512  # Generate calls in flight; beyond -> RESOURCE_EXHAUSTED
    routing: str = "least-load"
    drain_grace_s: float = 45.0
    served_model_name: str | None = None
    max_model_len: int | None = None  # default: the engines' (or config.json's) context window
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    dns_refresh_s: float = 5.0

    def __post_init__(self) -> None:
        path = Path(self.model)
        if not path.is_dir():
            raise ConfigError(f"--model {self.model!r} is not a directory: pass the model directory the "
                              "engines serve (the frontend reads its tokenizer files and config.json)")
        if not (path / "tokenizer.json").is_file():
            raise ConfigError(f"--model {self.model!r} has no tokenizer.json (only fast tokenizers work)")
        if not self.engines or not all(isinstance(e, str) and e.strip() for e in self.engines):
            raise ConfigError("--engine needs at least one host:port or dns:///name:port target")
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise ConfigError(f"--{name.replace('_', '-')} must be in [0, 65535], got {value}")
        if self.max_concurrent_requests < 1:
            raise ConfigError(f"--max-concurrent-requests must be >= 1, got {self.max_concurrent_requests}")
        if self.routing not in ROUTING_POLICIES:
            raise ConfigError(f"--routing must be one of {', '.join(ROUTING_POLICIES)}, got {self.routing!r}")
        if self.drain_grace_s < 0:
            raise ConfigError(f"--drain-grace-period must be >= 0, got {self.drain_grace_s}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        if self.max_message_bytes < 1024:
            raise ConfigError(f"--max-message-bytes must be >= 1024, got {self.max_message_bytes}")
        if self.dns_refresh_s <= 0:
            raise ConfigError(f"dns_refresh_s must be > 0, got {self.dns_refresh_s}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name

    def hf_config(self) -> dict[str, Any]:
        """The model's config.json ({} when it has none)."""
        path = Path(self.model) / "config.json"
        if not path.is_file():
            return {}
        data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        return data


def parse_engine_list(spec: str) -> tuple[str, ...]:
    """`--engine a:1,b:2` -> ("a:1", "b:2"); blanks are dropped."""
    return tuple(part.strip() for part in spec.split(",") if part.strip())
