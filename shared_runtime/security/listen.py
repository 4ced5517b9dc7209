"""Listening sockets for both services: exclusive ports, TLS or plaintext, an optional health-only port.

- `SO_REUSEPORT` is off (`grpc.so_reuseport` = 0; grpc turns it on by default), so a second server on
  a port that is taken fails to start instead of silently sharing the port with the first.
- `add_port` raises `BindError` with a message that names the address (grpc's own says only "Failed to
  bind"); the command-line entry points print it and exit non-zero.
- `start_health_server` serves only `grpc.health.v1` in plaintext on its own port: Kubernetes' built-in
  gRPC probes cannot present client certificates, so with mutual TLS the probes use this port.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2_grpc

from shared_runtime.security.tls import ServerTls

NO_REUSEPORT = ("grpc.so_reuseport", 0)


class BindError(RuntimeError):
    """A port could not be bound (taken, or the address is not on this host)."""


def join_host_port(host: str, port: int) -> str:
    """`host:port`, with an IPv6 literal in brackets."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def add_port(server: grpc.aio.Server, host: str, port: int, tls: ServerTls | None = None) -> int:
    """Bind `host:port` (TLS when `tls` is given); returns the bound port."""
    address = join_host_port(host, port)
    try:
        if tls is None:
            return int(server.add_insecure_port(address))
        return int(server.add_secure_port(address, tls.credentials()))
    except RuntimeError as exc:
        raise BindError(f"cannot listen on {address}: the port is in use or the address is not on this "
                        f"host ({exc})") from None


async def start_health_server(health_servicer: object, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """A plaintext server with only the health service (for probes that cannot do TLS)."""
    server = grpc.aio.server(options=[NO_REUSEPORT])
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = add_port(server, host, port)
    await server.start()
    return server, bound
