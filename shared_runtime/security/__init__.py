"""Transport security and authentication that both services share (neither may import the other).

- `auth`: API keys / the engine token (`KeySet`, constant-time `authorization: Bearer` checks, a grpc.aio
  server interceptor, client interceptors that add a token); usable by any API, not only gRPC.
- `tls`: TLS / mutual-TLS credentials with certificates re-read on change or SIGHUP.
- `listen`: exclusive (no SO_REUSEPORT) listening ports, and the plaintext health-only port.
- `filewatch`: noticing replaced certificate and key files.

Only grpc and the standard library are imported here. See docs/security.md.
"""
