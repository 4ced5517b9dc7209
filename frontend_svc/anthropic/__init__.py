"""The Anthropic Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) on the OpenAI HTTP port,
with vLLM 0.32's behaviour (docs/anthropic.md)."""
