"""Engines that span nodes: the command link between node 0 (the engine) and headless worker nodes.

    node 0: engine + MultiprocExecutor (local ranks) --TCP, one per node--> node k: `tandem-engine --headless`
            commands (every step, as broadcast locally)  ------------->    relay: commands -> its local shm
            answers / a failure report                   <-------------    queue; its answer pipe -> TCP

Each node runs world / nnodes ranks: node k holds global ranks [k*L, (k+1)*L). torch.distributed joins all
of them at `tcp://master_addr:master_port`; the command link listens on `master_port + 1` on node 0.
The shared-memory ring buffer stays the transport for readers on the same node; a headless node's relay
is its one remote reader and re-broadcasts each command into its own ring (the source documents' socket
fallback for readers on other nodes).

Frames: one kind byte, an 8-byte little-endian length, the payload. Node -> engine: HELLO (once, first:
its node rank, a newline, its configuration's fingerprint, executor/fingerprint.py), ANSWER (the answer
rank's reply, when that rank lives on the node), FAILURE (why the node is going down). Engine -> node:
WELCOME (once, the fingerprint matched) or FAILURE (why the node is refused: the differing flags), then
COMMAND frames, each an encoded command. A headless node starts its workers only after WELCOME.

Failure model: a node that does not connect within `join_timeout_s` fails start-up naming its ranks; a
node whose link closes or that reports a failure fails the engine as a dead local worker does
(WorkerDiedError); a headless node whose engine link closes before SHUTDOWN, or whose worker dies,
stops its workers and exits non-zero, so an orchestrator restarts the group.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from multiprocessing.connection import wait

from engine_svc.config import EngineConfig
from engine_svc.executor.fingerprint import encode_fingerprint, fingerprint_mismatch

COMMAND, ANSWER, FAILURE, HELLO, WELCOME = 1, 2, 3, 4, 5
_HEADER = struct.Struct("<BQ")
JOIN_TIMEOUT_ENV = "TANDEM_NODE_JOIN_TIMEOUT_S"


class LinkClosed(ConnectionError):
    """The peer closed the link (or it broke)."""


def send_frame(sock: socket.socket, kind: int, payload: bytes | bytearray | memoryview = b"") -> None:
    sock.sendall(_HEADER.pack(kind, len(payload)) + bytes(payload))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise LinkClosed("link closed")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket) -> tuple[int, bytes]:
    """(kind, payload); LinkClosed when the peer is gone."""
    try:
        kind, size = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
        return kind, _recv_exact(sock, size)
    except OSError as exc:
        if isinstance(exc, LinkClosed):
            raise
        raise LinkClosed(str(exc)) from exc


def join_timeout_s() -> float:
    return float(os.environ.get(JOIN_TIMEOUT_ENV, "300"))


def local_ranks(config: EngineConfig) -> range:
    """The global ranks that run on this node."""
    per_node = config.world_size // config.nnodes
    return range(config.node_rank * per_node, (config.node_rank + 1) * per_node)


def dist_init_method(config: EngineConfig) -> str:
    return f"tcp://{config.master_addr}:{config.master_port}"


class RemoteNode:
    """Node 0's end of one headless node's link."""

    def __init__(self, node_rank: int, sock: socket.socket, ranks: range) -> None:
        self.node_rank, self.sock, self.ranks = node_rank, sock, ranks
        self.failure: str | None = None

    def fileno(self) -> int:  # for multiprocessing.connection.wait
        return self.sock.fileno()

    def send_command(self, message: bytes | bytearray) -> None:
        try:
            send_frame(self.sock, COMMAND, message)
        except OSError as exc:
            raise LinkClosed(str(exc)) from exc

    def read(self) -> bytes:
        """The next ANSWER's payload; LinkClosed (with `failure` set) on a FAILURE frame or a closed link."""
        try:
            kind, payload = recv_frame(self.sock)
        except LinkClosed:
            self.failure = self.failure or f"node {self.node_rank} (ranks {self.ranks.start}-{self.ranks.stop - 1}) " \
                                            "closed its link"
            raise
        if kind == FAILURE:
            self.failure = f"node {self.node_rank}: {payload.decode(errors='replace')}"
            raise LinkClosed(self.failure)
        return payload

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class AnswerLink:
    """The answer pipe's interface (`recv_bytes`, `poll`, `fileno`) over a remote node's link, for when
    the answering rank lives on that node."""

    def __init__(self, node: RemoteNode) -> None:
        self.node = node

    def fileno(self) -> int:
        return self.node.fileno()

    def recv_bytes(self) -> bytes:
        try:
            return self.node.read()
        except LinkClosed as exc:
            raise EOFError(str(exc)) from exc

    def poll(self, timeout: float = 0.0) -> bool:
        return bool(wait([self.node.sock], timeout))

    def close(self) -> None:
        self.node.close()


def accept_nodes(config: EngineConfig, timeout_s: float | None = None) -> list[RemoteNode]:
    """Node 0: wait for every headless node to connect (HELLO with its rank) within the deadline.
    RuntimeError naming the nodes and ranks that never joined."""
    per_node = config.world_size // config.nnodes
    deadline = time.monotonic() + (join_timeout_s() if timeout_s is None else timeout_s)
    nodes: dict[int, RemoteNode] = {}
    with socket.create_server((config.master_addr, int(config.master_port or 0) + 1), reuse_port=False) as server:
        while len(nodes) < config.nnodes - 1:
            left = deadline - time.monotonic()
            if left <= 0 or not wait([server], left):
                missing = [k for k in range(1, config.nnodes) if k not in nodes]
                for node in nodes.values():
                    node.close()
                raise RuntimeError(
                    "headless node(s) never joined within "
                    f"{join_timeout_s() if timeout_s is None else timeout_s:.0f} s: "
                    + "; ".join(f"node {k} (ranks {k * per_node}-{(k + 1) * per_node - 1})" for k in missing)
                    + f" (start `tandem-engine --headless --node-rank K --master-addr {config.master_addr} "
                      f"--master-port {config.master_port} ...` on each)")
            sock, _ = server.accept()
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(max(1.0, deadline - time.monotonic()))
            try:
                kind, payload = recv_frame(sock)
            except (LinkClosed, TimeoutError):
                sock.close()
                continue
            sock.settimeout(None)
            head, _, theirs = payload.partition(b"\n")
            rank = int(head.decode()) if kind == HELLO and head.isdigit() else -1
            if not 0 < rank < config.nnodes or rank in nodes:
                sock.close()
                continue
            mismatch = fingerprint_mismatch(config, theirs, rank)
            if mismatch is not None:
                with contextlib.suppress(OSError):
                    send_frame(sock, FAILURE, mismatch.encode())
                sock.close()
                for node in nodes.values():
                    node.close()
                raise RuntimeError(mismatch)
            send_frame(sock, WELCOME)
            nodes[rank] = RemoteNode(rank, sock, range(rank * per_node, (rank + 1) * per_node))
    return [nodes[k] for k in sorted(nodes)]


def connect_to_engine(config: EngineConfig, timeout_s: float | None = None) -> socket.socket:
    """A headless node: connect to node 0's command link (retrying until the deadline), say hello with
    this node's fingerprint and wait to be welcomed. RuntimeError with node 0's reason when refused."""
    deadline = time.monotonic() + (join_timeout_s() if timeout_s is None else timeout_s)
    address = (config.master_addr, int(config.master_port or 0) + 1)
    while True:
        try:
            sock = socket.create_connection(address, timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"could not reach the engine's node link at {address[0]}:{address[1]}") from None
            time.sleep(0.2)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        send_frame(sock, HELLO, str(config.node_rank).encode() + b"\n" + encode_fingerprint(config))
        kind, payload = recv_frame(sock)
    except (OSError, LinkClosed):
        sock.close()
        raise RuntimeError(f"the engine at {address[0]}:{address[1]} closed the node link before accepting "
                           "this node") from None
    if kind != WELCOME:
        sock.close()
        raise RuntimeError(payload.decode(errors="replace") if kind == FAILURE else
                           f"the engine at {address[0]}:{address[1]} answered with frame kind {kind}")
    return sock
