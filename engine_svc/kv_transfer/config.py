"""`--kv-transfer-config`: vLLM's JSON object (`kv_connector`, `kv_role`, ...), parsed and validated.

Roles: `kv_producer` keeps the K/V of requests that ask for it (`do_remote_decode`) for a consumer to
pull; `kv_consumer` pulls K/V for requests that name a producer (`do_remote_prefill`); `kv_both` does
either. `kv_lease_duration_s` bounds how long a producer holds blocks nobody pulls;
`kv_load_failure_policy` says what a consumer does when a pull fails: `recompute` (compute the prompt
itself: the request is served, only slower) or `fail` (the request ends with an UNAVAILABLE error).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_ROLE_ALIASES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}  # --kv-role
KV_CONNECTORS = ("GrpcConnector",)
FAILURE_POLICIES = ("recompute", "fail")
DEFAULT_CHUNK_BYTES = 1 << 20  # PullKvBlocks chunk size: well under every gRPC message limit


class KVTransferConfigError(ValueError):
    """A --kv-transfer-config value that cannot be used; the message names the field."""


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str = "GrpcConnector"
    kv_role: str = "kv_both"
    kv_lease_duration_s: float = 60.0
    kv_load_failure_policy: str = "recompute"
    kv_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    kv_pull_timeout_s: float = 30.0
    # Host a consumer reaches this engine at (put in kv_transfer_params.remote_host); default: the bind host.
    kv_advertise_host: str = ""
    # Under TLS, the name producers' certificates carry (they are verified against it instead of the host
    # pulled from: pod addresses come and go; e.g. the engines' Service name); default: that host.
    kv_ssl_server_name: str = ""
    # A producer's plain TCP side channel for the bytes of pulls (side_channel.py): -1 none (the bytes go in
    # the gRPC stream), 0 any free port, else that port (open it to consumers beside the gRPC port).
    kv_side_channel_port: int = -1
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        for name, value, allowed in (("kv_connector", self.kv_connector, KV_CONNECTORS),
                                     ("kv_role", self.kv_role, KV_ROLES),
                                     ("kv_load_failure_policy", self.kv_load_failure_policy, FAILURE_POLICIES)):
            if value not in allowed:
                raise KVTransferConfigError(f"kv_transfer_config.{name}: {value!r} is not one of {', '.join(allowed)}")
        if not self.kv_lease_duration_s > 0:
            raise KVTransferConfigError("kv_transfer_config.kv_lease_duration_s must be > 0")
        if not self.kv_pull_timeout_s > 0:
            raise KVTransferConfigError("kv_transfer_config.kv_pull_timeout_s must be > 0")
        if not -1 <= self.kv_side_channel_port <= 65535:
            raise KVTransferConfigError("kv_transfer_config.kv_side_channel_port must be -1 (none), 0 (any free "
                                        "port) or a port number")
        if not 1024 <= self.kv_chunk_bytes <= 16 << 20:
            raise KVTransferConfigError("kv_transfer_config.kv_chunk_bytes must be in [1024, 16 MiB]")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_json(cls, text: str) -> KVTransferConfig:
        """Parse the flag's JSON object; unknown keys and wrong types are errors naming the key."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise KVTransferConfigError(f"kv_transfer_config is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise KVTransferConfigError("kv_transfer_config must be a JSON object")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise KVTransferConfigError(f"kv_transfer_config: unknown key(s) {', '.join(unknown)}; "
                                        f"known: {', '.join(known)}")
        for key, value in raw.items():
            default = getattr(cls, key, None) if key != "kv_connector_extra_config" else {}
            expected = (int, float) if isinstance(default, float) else type(default)
            if isinstance(value, bool) != isinstance(default, bool) or not isinstance(value, expected):
                raise KVTransferConfigError(f"kv_transfer_config.{key}: expected {type(default).__name__}, "
                                            f"got {json.dumps(value)}")
        return cls(**raw)
