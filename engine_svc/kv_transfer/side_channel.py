"""A plain TCP side channel for the bytes of a pull; gRPC (`PullKvBlocks`) keeps the control.

A consumer that pulls in plaintext offers it (`PullKvBlocksRequest.accept_side_channel`); a producer with
a side channel (`kv_side_channel_port` >= 0) takes the offer: the stream's first chunk names the port and a
one-time ticket (32 random bytes) instead of carrying data; the consumer connects to the producer's host
on that port, sends the ticket, and receives exactly the pull's bytes, sent span by span (source.py: no
per-chunk messages, no copies into protobufs) - a span that is a list of buffers (the cache's own memory,
block part by block part) goes out in `sendmsg` calls of up to IOV_MAX buffers each, with no copy on the
producer's side - and received straight into the consumer's buffer; the stream's last chunk then carries
the spans' CRC-32 sums as on the gRPC path (checksum.py). The ticket travels over the authenticated gRPC stream and is good
for one connection, only while that stream is open (`withdraw` ends it, closing a transfer in progress);
a connection without a live ticket is closed unread. Plaintext only: an engine serving TLS may not run one
(refused at start), and a consumer pulling over TLS never offers it.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import secrets
import socket
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine_svc.kv_transfer.checksum import SpanSums

TICKET_BYTES = 32
_HANDSHAKE_TIMEOUT_S = 10.0
_RECV_STEP = 4 << 20  # the most one recv_into asks for


def _iov_max() -> int:
    try:
        return max(1, min(int(os.sysconf("SC_IOV_MAX")), 1024))
    except (AttributeError, ValueError, OSError):
        return 16  # POSIX's least IOV_MAX


IOV_MAX = _iov_max()  # the most buffers one sendmsg takes

Buffer = bytes | bytearray | memoryview


@dataclass
class Transfer:
    """One offered pull: its bytes, piece by piece (read when sent; a piece is one buffer or a list of
    buffers sent in order), and when its connection finished (`done`; `error` says if it failed)."""

    pieces: Iterable[Buffer | list[memoryview]]
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    conn: socket.socket | None = None


class SideChannelServer:
    """The producer's listener: one thread accepting, one thread per connection sending."""

    def __init__(self, host: str, port: int) -> None:
        """Listen on `host` (the engine's bind host; "", "0.0.0.0", "::" or "[::]": every address) and `port`
        (0: any free one, then in `port`)."""
        host = host.strip("[]")
        if host in ("", "::"):
            self._sock = socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=True) \
                if socket.has_dualstack_ipv6() else socket.create_server(("0.0.0.0", port))
        else:
            self._sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.port = int(self._sock.getsockname()[1])
        self._lock = threading.Lock()
        self._pending: dict[bytes, Transfer] = {}
        self._closed = False
        self.num_sent = 0  # transfers sent whole (cumulative)
        threading.Thread(target=self._accept, daemon=True, name="kv-side-channel").start()

    def offer(self, pieces: Iterable[Buffer | list[memoryview]]) -> tuple[bytes, Transfer]:
        """A ticket for the bytes of `pieces`, iterated once when the consumer connects (good for one
        connection until `withdraw`)."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        transfer = Transfer(pieces)
        with self._lock:
            self._pending[ticket] = transfer
        return ticket, transfer

    def withdraw(self, ticket: bytes) -> None:
        """The pull's stream ended: the ticket is void, and a transfer still sending is cut off."""
        with self._lock:
            transfer = self._pending.pop(ticket, None)
        if transfer is not None and transfer.conn is not None and not transfer.done.is_set():
            with contextlib.suppress(OSError):
                transfer.conn.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), daemon=True, name="kv-side-send").start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            transfer = None
            try:
                conn.settimeout(_HANDSHAKE_TIMEOUT_S)
                ticket = _recv_exactly(conn, TICKET_BYTES)
                with self._lock:
                    transfer = next((t for k, t in self._pending.items() if hmac.compare_digest(k, ticket)), None)
                    if transfer is None or transfer.conn is not None:
                        return  # unknown, withdrawn or already used: closed unread
                    transfer.conn = conn
                conn.settimeout(None)
                for piece in transfer.pieces:
                    if isinstance(piece, list):
                        send_views(conn, piece)
                    else:
                        conn.sendall(piece)
                conn.shutdown(socket.SHUT_WR)
                with self._lock:
                    self.num_sent += 1
            except Exception as exc:  # a failed read of the cache too: the consumer sees the bytes stop short
                if transfer is not None:
                    transfer.error = f"{type(exc).__name__}: {exc}"
            finally:
                if transfer is not None:
                    close = getattr(transfer.pieces, "close", None)
                    if close is not None:  # a generator left mid-way ends here, not on whatever thread drops it
                        close()
                    transfer.done.set()


def send_views(conn: socket.socket, views: list[memoryview], iov_max: int = IOV_MAX) -> None:
    """Send every byte of `views` in order, with no copy in this process: `sendmsg` over up to `iov_max`
    buffers at a time, going on from where a short write stopped (inside a buffer too)."""
    index, offset, count = 0, 0, len(views)
    while index < count:
        batch = views[index:index + iov_max]
        if offset:
            batch[0] = batch[0][offset:]
        sent = conn.sendmsg(batch)
        if sent <= 0 and any(len(view) for view in batch):
            raise ConnectionError("the side channel took no bytes")
        while index < count and sent >= len(views[index]) - offset:  # whole buffers sent (empty ones too)
            sent -= len(views[index]) - offset
            index, offset = index + 1, 0
        offset += sent


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        r = conn.recv_into(view[got:])
        if not r:
            raise ConnectionError(f"the peer closed after {got} of {n} bytes")
        got += r
    return bytes(buf)


def receive(host: str, port: int, ticket: bytes, buffer: memoryview, timeout_s: float,
            sums: SpanSums | None = None) -> None:
    """The consumer's side: connect, present `ticket`, read exactly `len(buffer)` bytes straight into
    `buffer` (ValueError if the producer sends fewer or more). `sums`, if given, is told of each step of
    bytes as it arrives (it sums them on its own thread while the rest arrives)."""
    size = len(buffer)
    with socket.create_connection((host, port), timeout=timeout_s) as conn:
        conn.sendall(ticket)
        got = 0
        while got < size:
            r = conn.recv_into(buffer[got:], min(size - got, _RECV_STEP))
            if not r:
                raise ValueError(f"the side channel closed after {got} of {size} bytes")
            got += r
            if sums is not None:
                sums.arrived(got)
        if conn.recv(1):
            raise ValueError(f"the side channel sent more than the {size} bytes of the pull")
