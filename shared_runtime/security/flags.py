"""The transport-security flags of the services' command lines, defined once.

- `add_tls_args(group, prefix, side=..., peer=...)` adds `{prefix}-certfile`, `{prefix}-keyfile` and
  `{prefix}-ca-certs`: on the `SERVER` side they serve TLS (the CA bundle requires client certificates:
  mutual TLS); on the `CLIENT` side they dial with TLS (the CA bundle verifies the server and turns TLS
  on; certificate + key are the client certificate). `tls_files(args, prefix)` reads them back as
  `TlsFiles`, whose errors name the same flags.
- `add_engine_token_arg(group, side)`: `--engine-token-file`, the token an engine requires (SERVER: the
  accepted tokens, one per line; CLIENT: the token sent, the file's first line). Both re-read on change.
- `add_api_key_args(group)`: `--api-key` (repeatable) and `--api-key-file`, the public API's keys.
"""

from __future__ import annotations

import argparse
from typing import Literal

from shared_runtime.security.auth import API_KEY_ENV
from shared_runtime.security.tls import TlsFiles

Side = Literal["server", "client"]
SERVER: Side = "server"
CLIENT: Side = "client"
ENGINE_TOKEN_FLAG = "--engine-token-file"
API_KEY_FLAG_WARNING = ("an API key given with --api-key is visible to every local user (`ps`, /proc): prefer "
                        "--api-key-file FILE (mode 0600) or $TANDEM_API_KEY")
_SUFFIXES = ("-certfile", "-keyfile", "-ca-certs")


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def add_tls_args(group: argparse._ArgumentGroup, prefix: str = "--ssl", *, side: Side = SERVER,
                 peer: str = "clients") -> None:
    """`peer`: who is on the other end, for the help texts (e.g. "frontends", "engines")."""
    if side == SERVER:
        helps = ("PEM certificate chain: serve TLS", f"PEM private key of {prefix}-certfile",
                 f"PEM CA bundle: the {peer} must present a certificate signed by it (mutual TLS)")
    else:
        helps = (f"PEM client certificate for the {peer} (mutual TLS)", f"PEM private key of {prefix}-certfile",
                 f"PEM CA bundle that verifies the {peer}' certificates (turns TLS to the {peer} on)")
    for suffix, text in zip(_SUFFIXES, helps):
        group.add_argument(prefix + suffix, default=None, help=text)


def tls_files(args: argparse.Namespace, prefix: str = "--ssl") -> TlsFiles:
    certfile, keyfile, ca_certs = (getattr(args, _dest(prefix + suffix)) for suffix in _SUFFIXES)
    return TlsFiles(certfile, keyfile, ca_certs, prefix=prefix)


def add_engine_token_arg(group: argparse._ArgumentGroup, side: Side) -> None:
    text = ("file with the accepted engine token(s), one per line (re-read when it changes)" if side == SERVER
            else "file whose first line is the token the engines require (re-read when it changes)")
    group.add_argument(ENGINE_TOKEN_FLAG, default=None, help=text)


def add_api_key_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--api-key", action="append", default=[],
                       help=f"accepted API key (repeatable); clients send 'authorization: Bearer <key>'. "
                            f"Shows in `ps`: prefer --api-key-file or ${API_KEY_ENV}")
    group.add_argument("--api-key-file", default=None,
                       help="file with one accepted API key per line (re-read when it changes)")
