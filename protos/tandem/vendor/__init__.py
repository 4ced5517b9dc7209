"""SMG's engine protocol (PyPI smg-grpc-proto 0.4.28, Apache-2.0), vendored; see the .proto headers."""
