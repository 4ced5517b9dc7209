"""vLLM's public gRPC API (package `vllm`: services Inference and Control; Apache-2.0), vendored; see the
.proto headers."""
