"""Shared-secret authentication: API keys on the public API, the engine token between the tiers.

`KeySet` is the check, independent of any transport, so the gRPC services and an HTTP API use the same
code: `keys.check_authorization(header)` takes the value of an `authorization: Bearer <key>` header.
`AuthInterceptor` applies it to a grpc.aio server; `bearer_token_interceptors` add a token to every
call of a grpc.aio channel (the frontend's calls to the engines).

Invariants:
- Every presented key is compared with *every* accepted key, in constant time (`hmac.compare_digest`
  over SHA-256 digests, so neither the position of the matching key nor the keys' lengths show in the
  timing), with no early exit.
- Secrets never reach a log line or an error message: logs name the key sources and counts only.
- Key files (one key per line; blank lines and `#` comments ignored) are re-read when they change
  (checked at most once a second) or on `reload()` (SIGHUP), so keys rotate without a restart. A file
  that became unreadable or empty keeps the previous keys (and says so in the log).
- Health (`grpc.health.v1.Health`) is exempt: Kubernetes probes carry no credentials. Reflection is
  not: it needs a key like the API it describes (`grpcurl -H 'authorization: Bearer ...'` sends it).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from shared_runtime.security.filewatch import FileWatch

logger = logging.getLogger(__name__)

API_KEY_ENV = "TANDEM_API_KEY"
HEALTH_SERVICE = "grpc.health.v1.Health"
UNAUTHENTICATED_MESSAGE = "missing or invalid credentials: send 'authorization: Bearer <key>'"
_RECHECK_S = 1.0


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()


def read_key_file(path: str) -> list[str]:
    """The keys in a file: one per line, surrounding whitespace stripped, blanks and `#` lines skipped."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def bearer_token(header: str | None) -> str | None:
    """The credential of an `authorization` header value `Bearer <token>` (scheme case-insensitive)."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class KeySet:
    """The accepted secrets: fixed ones (flags, environment) plus those of watched key files."""

    def __init__(self, keys: Iterable[str] = (), files: Sequence[str] = (), *, name: str = "API key") -> None:
        self.name = name
        self._fixed = [_digest(k) for k in keys if k]
        self._files = tuple(files)
        self._file_keys: list[bytes] = []
        self._watch = FileWatch(self._files)
        self._lock = threading.Lock()
        self._next_check = 0.0
        self._load_files(initial=True)

    @classmethod
    def from_sources(cls, keys: Iterable[str] = (), key_file: str | None = None, *,
                     env: Mapping[str, str] | None = None, env_var: str | None = API_KEY_ENV,
                     name: str = "API key") -> KeySet | None:
        """Keys from flags, an optional file and an environment variable; None when no source gave any
        (authentication off). Raises ValueError when a named file cannot be read or holds no key."""
        env = os.environ if env is None else env
        fixed = [k.strip() for k in keys if k and k.strip()]
        if env_var and env.get(env_var, "").strip():
            fixed.append(env[env_var].strip())
        if not fixed and key_file is None:
            return None
        return cls(fixed, [key_file] if key_file else [], name=name)

    def __len__(self) -> int:
        return len(self._fixed) + len(self._file_keys)

    def _load_files(self, initial: bool = False) -> None:
        keys: list[bytes] = []
        try:
            for path in self._files:
                keys.extend(_digest(k) for k in read_key_file(path))
        except (OSError, UnicodeDecodeError) as exc:
            if initial:
                raise ValueError(f"cannot read the {self.name} file: {exc}") from None
            logger.error("cannot re-read the %s file (keeping the previous keys): %s", self.name, exc)
            return
        if self._files and not keys:
            if initial:
                raise ValueError(f"the {self.name} file {', '.join(self._files)} holds no key")
            logger.error("the %s file is now empty; keeping the previous keys", self.name)
            return
        self._file_keys = keys
        if not initial:
            logger.info("%s file re-read: %d key(s)", self.name, len(keys))

    def reload(self) -> None:
        """Re-read the key files now (SIGHUP)."""
        with self._lock:
            self._watch.mark_seen()
            self._load_files()

    def _refresh(self) -> None:
        """Re-read the key files if they changed (stat at most once a second)."""
        if not self._files:
            return
        now = time.monotonic()
        if now < self._next_check:
            return
        with self._lock:
            self._next_check = now + _RECHECK_S
            if self._watch.changed():
                self._load_files()

    def accepts(self, presented: str | None) -> bool:
        """Whether `presented` is one of the keys; constant time over every key, no early exit."""
        if presented is None:
            return False
        self._refresh()
        digest = _digest(presented)
        found = False
        for key in (*self._fixed, *self._file_keys):
            found |= hmac.compare_digest(key, digest)
        return found

    def check_authorization(self, header: str | None) -> bool:
        """Whether an `authorization` header value carries an accepted bearer key."""
        return self.accepts(bearer_token(header))

    def first_key_file(self) -> str | None:
        return self._files[0] if self._files else None


def metadata_value(metadata: Iterable[tuple[str, Any]] | None, key: str) -> str | None:
    """The first value of `key` in gRPC metadata (None when absent or binary)."""
    for name, value in metadata or ():
        if name == key:
            return value if isinstance(value, str) else None
    return None


def _service_of(method: str) -> str:
    """`/pkg.Service/Method` -> `pkg.Service`."""
    return method.lstrip("/").split("/", 1)[0]


async def _deny(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
    """UNAUTHENTICATED, set and returned rather than raised with `context.abort`: grpc keeps an abort's
    exception in the call's state, and its traceback would hold this frame's request bytes in a
    reference cycle until a full garbage collection."""
    context.set_code(grpc.StatusCode.UNAUTHENTICATED)
    context.set_details(UNAUTHENTICATED_MESSAGE)


def _denying(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape that answers UNAUTHENTICATED without parsing the request."""
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_deny)
    return grpc.unary_unary_rpc_method_handler(_deny)


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Lets a call through only with an accepted `authorization: Bearer <key>` (exempt services aside)."""

    def __init__(self, keys: KeySet, exempt_services: Iterable[str] = (HEALTH_SERVICE,)) -> None:
        self._keys = keys
        self._exempt = frozenset(exempt_services)

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or _service_of(handler_call_details.method) in self._exempt:
            return handler
        header = metadata_value(handler_call_details.invocation_metadata, "authorization")
        if self._keys.check_authorization(header):
            return handler
        return _denying(handler)


class BearerToken:
    """The token a client sends: the first key of a file, re-read when the file changes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._watch = FileWatch([path])
        keys = read_key_file(path)
        if not keys:
            raise ValueError(f"the token file {path} holds no token")
        self._header = f"Bearer {keys[0]}"

    @property
    def header(self) -> str:
        if self._watch.changed():
            try:
                keys = read_key_file(self.path)
            except (OSError, UnicodeDecodeError) as exc:
                logger.error("cannot re-read the token file (keeping the previous token): %s", exc)
                keys = []
            if keys:
                self._header = f"Bearer {keys[0]}"
                logger.info("token file re-read")
        return self._header


def _with_token(details: grpc.aio.ClientCallDetails, token: BearerToken) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    metadata["authorization"] = token.header
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


class _AddToken:
    def __init__(self, token: BearerToken) -> None:
        self._token = token


class _UnaryUnary(_AddToken, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_token(details, self._token), request)


class _UnaryStream(_AddToken, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_token(details, self._token), request)


class _StreamUnary(_AddToken, grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(_with_token(details, self._token), request_iterator)


class _StreamStream(_AddToken, grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(_with_token(details, self._token), request_iterator)


def bearer_token_interceptors(token: BearerToken) -> list[Any]:
    """Client interceptors adding `authorization: Bearer <token>` to every call on a grpc.aio channel
    (one per call shape: grpc.aio files an interceptor under the first shape it implements only)."""
    return [cls(token) for cls in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]
