"""What both ends of the frontend <-> engine gRPC link must agree on, defined once.

- `MAX_MESSAGE_BYTES`: the largest message either end sends or accepts on the link (the engine's
  `--max-message-bytes` default; the engine splits queued outputs below it). The frontend uses it too
  for the largest response it sends to clients.
- `KEEPALIVE_OPTIONS`: pings that keep the long-lived, often idle `Connect` streams alive through
  proxies and notice a dead peer. The engine server also accepts pings without data every 5 s
  (`SERVER_PING_OPTIONS`), more often than a client sends them, so it never answers them with GOAWAY.
"""

from __future__ import annotations

MAX_MESSAGE_BYTES = 64 * 1024 * 1024

KEEPALIVE_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)

SERVER_PING_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
)


def message_size_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """grpc's send and receive limits, both set to `max_message_bytes`."""
    return [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes)]
