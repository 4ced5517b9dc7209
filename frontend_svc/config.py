"""Frontend configuration: one frozen dataclass, validated at construction.

Every check raises `ConfigError` naming the flag and what to do about it. The model directory is read
only for its tokenizer files and `config.json` (vocabulary size, context window); the weights live on
the engines. Without --model (`model` None) the CLI fetches those files from the engines
(tokenizer_fetch.py) and continues with a config naming the directory it wrote them to.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from frontend_svc.engines.router import POLICIES, CacheAwareSettings
from frontend_svc.gguf_tokenizer import is_gguf, model_limits, read_metadata
from frontend_svc.openai.tool_parsers import TOOL_CALL_PARSER_NAMES
from shared_runtime.security.http_limits import HttpLimits
from shared_runtime.security.tls import TlsConfigError, TlsFiles

ROUTING_POLICIES = POLICIES
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024


class ConfigError(ValueError):
    """A configuration value is invalid; the message says which and how to fix it."""


@dataclass(frozen=True)
class FrontendConfig:
    model: str | None  # None: fetch the tokenizer files from the engines (only the CLI does)
    engines: tuple[str, ...] = ("127.0.0.1:50051",)  # "host:port" or "dns:///name:port" entries
    host: str = "0.0.0.0"
    port: int = 50050  # 0 = any free port (tests)
    metrics_port: int = 9090  # reserved for Prometheus /metrics; 0 disables
    max_concurrent_requests: int = 512  # Generate calls in flight; beyond -> RESOURCE_EXHAUSTED
    routing: str = "least-load"  # the CLI's default: cache-aware when there can be several engines
    cache_aware: CacheAwareSettings = field(default_factory=CacheAwareSettings)
    drain_grace_s: float = 45.0
    served_model_name: str | None = None
    max_model_len: int | None = None  # default: the engines' (or config.json's) context window
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    dns_refresh_s: float = 5.0
    # Security (docs/security.md). TLS on the public port; mutual TLS when tls.ca_certs is given.
    tls: TlsFiles = field(default_factory=TlsFiles)
    engine_tls: TlsFiles = field(default_factory=lambda: TlsFiles(prefix="--engine-ssl"))
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # secrets: never in a repr or a log
    api_key_file: str | None = None  # one key per line, re-read when it changes
    engine_token_file: str | None = None  # the token sent to the engines on every call
    engine_ssl_server_name: str | None = None  # the name engine certificates carry (default: target host)
    health_port: int = 0  # plaintext grpc.health.v1 only (probes that cannot do TLS); 0 = off
    tokenizer_threads: int = 0  # threads tokenizing off the event loop; 0 = min(4, CPUs)
    http_port: int = 0  # the OpenAI-compatible HTTP API (frontend_svc/openai, docs/openai.md); 0 = off
    http_limits: HttpLimits = field(default_factory=HttpLimits)  # headers, timeouts, connection cap
    engine_tokenizer_sha256: str | None = None  # set when the tokenizer came from the engines (GetTokenizer)
    tokenizer_fetch_timeout_s: float = 600.0  # without --model: how long to wait for an engine's tokenizer
    tool_call_parser: str | None = None  # OpenAI tool_choice "auto": the model's call format (vLLM's flag)
    trust_request_chat_template: bool = False  # accept a chat request's own chat_template (vLLM's flag)
    stream_interval: int = 1  # tokens per streamed delta at least (vLLM's flag; output_processor.py)
    max_migrations: int = 3  # moves of a request to another engine when its own dies or drains; 0 = off
    migration_timeout_s: float = 10.0  # how long a moving request waits for a ready engine

    def __post_init__(self) -> None:
        if self.model is not None:
            self._check_model(self.model)
        if not self.engines or not all(isinstance(e, str) and e.strip() for e in self.engines):
            raise ConfigError("--engine needs at least one host:port or dns:///name:port target")
        for name in ("port", "metrics_port", "health_port", "http_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise ConfigError(f"--{name.replace('_', '-')} must be in [0, 65535], got {value}")
        if self.http_port and self.http_port == self.port:
            raise ConfigError(f"--http-port {self.http_port} is also --port: give the HTTP API its own port")
        if self.max_concurrent_requests < 1:
            raise ConfigError(f"--max-concurrent-requests must be >= 1, got {self.max_concurrent_requests}")
        if self.routing not in ROUTING_POLICIES:
            raise ConfigError(f"--routing must be one of {', '.join(ROUTING_POLICIES)}, got {self.routing!r}")
        for problem in self.cache_aware.problems():
            raise ConfigError(problem)
        if self.tokenizer_fetch_timeout_s <= 0:
            raise ConfigError(f"--tokenizer-fetch-timeout must be > 0, got {self.tokenizer_fetch_timeout_s}")
        if self.drain_grace_s < 0:
            raise ConfigError(f"--drain-grace-period must be >= 0, got {self.drain_grace_s}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        if self.max_message_bytes < 1024:
            raise ConfigError(f"--max-message-bytes must be >= 1024, got {self.max_message_bytes}")
        if self.dns_refresh_s <= 0:
            raise ConfigError(f"dns_refresh_s must be > 0, got {self.dns_refresh_s}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSER_NAMES:
            raise ConfigError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSER_NAMES)}, "
                              f"got {self.tool_call_parser!r}")
        if self.max_migrations < 0:
            raise ConfigError(f"--max-migrations must be >= 0, got {self.max_migrations}")
        if not self.migration_timeout_s > 0:
            raise ConfigError(f"--migration-timeout must be > 0, got {self.migration_timeout_s}")
        if self.stream_interval < 1:
            raise ConfigError(f"--stream-interval must be >= 1, got {self.stream_interval}")
        if self.tokenizer_threads < 0:
            raise ConfigError(f"--tokenizer-threads must be >= 0, got {self.tokenizer_threads}")
        self._check_security()

    @staticmethod
    def _check_model(model: str) -> None:
        path = Path(model)
        if not path.is_dir() and not is_gguf(path):
            raise ConfigError(f"--model {model!r} is not a directory or a .gguf file: pass the model the "
                              "engines serve (the frontend reads its tokenizer files and config.json), or leave "
                              "--model out to fetch them from the engines")
        if not is_gguf(path) and not (path / "tokenizer.json").is_file():
            raise ConfigError(f"--model {model!r} has no tokenizer.json (only fast tokenizers work)")

    def _check_security(self) -> None:
        try:
            self.tls.check_server()
            self.engine_tls.check_client()
        except TlsConfigError as exc:
            raise ConfigError(str(exc)) from None
        for flag, path in (("--api-key-file", self.api_key_file), ("--engine-token-file", self.engine_token_file)):
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"{flag} {path!r} is not a readable file")
        if any(not k.strip() for k in self.api_keys):
            raise ConfigError("--api-key must not be empty")
        if self.engine_ssl_server_name and not self.engine_tls.enabled:
            raise ConfigError("--engine-ssl-server-name needs TLS to the engines (--engine-ssl-ca-certs)")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model or "").name

    def hf_config(self) -> dict[str, Any]:
        """The model's config.json ({} when it has none); a .gguf file's vocabulary and context size."""
        if self.model is None:
            return {}
        if is_gguf(self.model):
            return model_limits(read_metadata(self.model))
        path = Path(self.model) / "config.json"
        if not path.is_file():
            return {}
        data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        return data


def parse_engine_list(spec: str) -> tuple[str, ...]:
    """`--engine a:1,b:2` -> ("a:1", "b:2"); blanks are dropped."""
    return tuple(part.strip() for part in spec.split(",") if part.strip())


def default_routing(engines: tuple[str, ...]) -> str:
    """`--routing`'s default: cache-aware when there can be more than one engine (several targets, or a
    dns:/// name), least-load for a single host:port (where every policy picks the same engine)."""
    if len(engines) > 1 or any(e.startswith("dns:") for e in engines):
        return "cache-aware"
    return "least-load"
