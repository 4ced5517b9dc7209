"""TLS for both services with grpcio's own credentials, certificates re-read without a restart.

Server side (`ServerTls`): `--ssl-certfile` + `--ssl-keyfile` turn TLS on; with `--ssl-ca-certs` the
server requires client certificates signed by that CA (mutual TLS). The credentials are
`grpc.dynamic_ssl_server_credentials`: grpc asks `ServerTls` for a new certificate configuration
before each new connection's handshake, and gets one whenever the files changed (inode, size or mtime;
Kubernetes Secret updates swap a symlink) or `reload()` ran (SIGHUP). Open connections keep the
certificate they were set up with, so streams are never dropped by a rotation.

Client side (`ClientTls`, the frontend's link to the engines): the files are read again for every new
channel, so a rotated client certificate is used from the next (re)connection on.

Invariants: a reload that fails (a file half-written, a key that does not match) keeps the previous
configuration and logs the error; a private key is never logged.
"""

from __future__ import annotations

import logging
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import grpc

from shared_runtime.security.filewatch import FileWatch

logger = logging.getLogger(__name__)
T = TypeVar("T")


class TlsConfigError(ValueError):
    """Bad TLS flags or unreadable certificate files; the message names the flag."""


def _read(path: str, flag: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TlsConfigError(f"{flag} {path!r} cannot be read: {exc.strerror or exc}") from None
    if not data.strip():
        raise TlsConfigError(f"{flag} {path!r} is empty")
    return data


@dataclass(frozen=True)
class TlsFiles:
    """Certificate chain, private key and (optional) CA bundle, as PEM file paths.

    `prefix` names the flags in error messages (`--ssl` or `--engine-ssl`)."""

    certfile: str | None = None
    keyfile: str | None = None
    ca_certs: str | None = None
    prefix: str = "--ssl"

    @property
    def enabled(self) -> bool:
        return any((self.certfile, self.keyfile, self.ca_certs))

    def check_server(self) -> None:
        """A server needs its certificate and key; a CA alone makes no sense there."""
        if not self.enabled:
            return
        if not (self.certfile and self.keyfile):
            raise TlsConfigError(f"{self.prefix}-certfile and {self.prefix}-keyfile go together "
                                 f"({self.prefix}-ca-certs additionally requires client certificates)")
        self.read()

    def check_client(self) -> None:
        """A client may give only a CA (server verification) or also its own certificate (mTLS)."""
        if bool(self.certfile) != bool(self.keyfile):
            raise TlsConfigError(f"{self.prefix}-certfile and {self.prefix}-keyfile go together")
        self.read()

    def read(self) -> tuple[bytes | None, bytes | None, bytes | None]:
        """(certificate chain, private key, CA bundle) as bytes; None for files not given."""
        cert = _read(self.certfile, f"{self.prefix}-certfile") if self.certfile else None
        key = _read(self.keyfile, f"{self.prefix}-keyfile") if self.keyfile else None
        ca = _read(self.ca_certs, f"{self.prefix}-ca-certs") if self.ca_certs else None
        return cert, key, ca

    @property
    def paths(self) -> list[str]:
        return [p for p in (self.certfile, self.keyfile, self.ca_certs) if p]

    def server_context(self) -> ssl.SSLContext:
        """A server `SSLContext` from the files (client certificates required with a CA bundle). Loading
        it is also the check that the certificate and key are whole and belong together."""
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(self.certfile or "", self.keyfile)
            if self.ca_certs:
                ctx.load_verify_locations(cafile=self.ca_certs)
                ctx.verify_mode = ssl.CERT_REQUIRED
        except (OSError, ssl.SSLError) as exc:
            raise TlsConfigError(f"{self.prefix}-certfile / {self.prefix}-keyfile / {self.prefix}-ca-certs "
                                 f"do not load as a certificate, its private key and a CA bundle: {exc}") from None
        return ctx


class ReloadingCredentials(Generic[T]):
    """Credentials built from `files` (`_build`), rebuilt when the files change or on `reload()`.

    `current` is what new handshakes get. A rebuild that fails keeps `current` and logs why; callers
    check for changes with `check()` at their own pace (before a handshake, say)."""

    what = "TLS certificates"

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._lock = threading.Lock()
        self._watch = FileWatch(files.paths)
        self.current: T = self._build()
        self.num_reloads = 0

    def _build(self) -> T:
        raise NotImplementedError

    def _loaded(self, built: T) -> None:
        """Hook: `built` is now `current` (called under the lock)."""

    def reload(self) -> bool:
        """Read the files now (SIGHUP); the next handshake uses them. False (and logged) on failure."""
        with self._lock:
            self._watch.mark_seen()
            return self._load()

    def check(self) -> None:
        """Rebuild if the files changed since they were last read."""
        with self._lock:
            if self._watch.changed():
                self._load()

    def _load(self) -> bool:
        try:
            built = self._build()
        except TlsConfigError as exc:
            logger.error("%s reload failed (keeping the current one): %s", self.what, exc)
            return False
        self.current = built
        self.num_reloads += 1
        self._loaded(built)
        logger.info("%s reloaded from %s", self.what, ", ".join(self.files.paths))
        return True


class ServerTls(ReloadingCredentials[grpc.ServerCertificateConfiguration]):
    """gRPC server credentials whose certificate, key and CA are re-read on change or on `reload()`."""

    def __init__(self, files: TlsFiles) -> None:
        files.check_server()
        self.require_client_auth = bool(files.ca_certs)
        self._pending: grpc.ServerCertificateConfiguration | None = None
        super().__init__(files)

    def _build(self) -> grpc.ServerCertificateConfiguration:
        self.files.server_context()  # grpc would refuse a torn or mismatched pair later, and silently
        cert, key, ca = self.files.read()
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def _loaded(self, built: grpc.ServerCertificateConfiguration) -> None:
        self._pending = built

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self.current, self._fetch, require_client_authentication=self.require_client_auth)

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """Called by grpc before every new handshake: a new configuration, or None for no change."""
        self.check()
        with self._lock:
            pending, self._pending = self._pending, None
            return pending


class ClientTls:
    """Channel credentials for the engines, read from the files for every new channel."""

    def __init__(self, files: TlsFiles) -> None:
        files.check_client()
        self.files = files

    def credentials(self) -> grpc.ChannelCredentials:
        try:
            cert, key, ca = self.files.read()
        except TlsConfigError as exc:  # mid-rotation: the next reconnect tries again
            logger.error("cannot read the engine TLS files: %s", exc)
            raise
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def server_tls(files: TlsFiles) -> ServerTls | None:
    return ServerTls(files) if files.enabled else None


def client_tls(files: TlsFiles) -> ClientTls | None:
    return ClientTls(files) if files.enabled else None
