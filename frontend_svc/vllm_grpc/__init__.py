"""vLLM's native gRPC API (`vllm.Inference`, the serving parts of `vllm.Control`) on the frontend's gRPC port."""
