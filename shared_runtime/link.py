"""What both ends of the frontend <-> engine gRPC link must agree on, defined once.

- `MAX_MESSAGE_BYTES`: the largest message either end sends or accepts on the link (the engine's
  `--max-message-bytes` default; the engine splits queued outputs below it). The frontend uses it too
  for the largest response it sends to clients.
- `engine_receive_limit(max_model_len)`: the largest message an engine accepts. An add carries at most
  max_model_len prompt ids (a packed uint32 is at most 5 bytes), so the limit follows max_model_len
  rather than `MAX_MESSAGE_BYTES`: a 60 MB add is refused by gRPC before it is parsed (it used to be
  parsed and copied into a Python list: +1.9 GB, other streams stalled ~8 s).
- `KEEPALIVE_OPTIONS`: pings that keep the long-lived, often idle `Connect` streams alive through
  proxies and notice a dead peer. The engine server also accepts pings without data every 5 s
  (`SERVER_PING_OPTIONS`), more often than a client sends them, so it never answers them with GOAWAY.
"""

from __future__ import annotations

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MIN_ENGINE_RECEIVE_BYTES = 4 * 1024 * 1024  # room for aborts of many requests, whatever max_model_len is
_ADD_OVERHEAD_BYTES = 64 * 1024  # request id, trace headers, 2 x 1024 stop / EOS ids, sampling params

KEEPALIVE_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)

SERVER_PING_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
)


def message_size_options(max_message_bytes: int = MAX_MESSAGE_BYTES,
                         max_receive_bytes: int | None = None) -> list[tuple[str, int]]:
    """grpc's send and receive limits: `max_message_bytes`, and `max_receive_bytes` (default the same)
    for what is received."""
    return [("grpc.max_receive_message_length", max_receive_bytes or max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes)]


def engine_receive_limit(max_model_len: int | None, max_message_bytes: int = MAX_MESSAGE_BYTES) -> int:
    """What an engine serving `max_model_len` tokens accepts in one message (see the module docstring);
    never more than `max_message_bytes`, never less than 4 MiB (unless `max_message_bytes` is)."""
    if not max_model_len:
        return max_message_bytes
    return min(max_message_bytes, max(MIN_ENGINE_RECEIVE_BYTES, 5 * max_model_len + _ADD_OVERHEAD_BYTES))
