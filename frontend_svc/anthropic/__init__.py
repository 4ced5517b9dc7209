"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) on the OpenAI HTTP port,
with vLLM 0.32's behaviour (docs/anthropic.md).

- `protocol.py`: the request bodies (unknown fields refused; `REFUSED` and `UnsupportedBlock` named).
- `convert.py`: a request -> the chat completion that produces its answer (the chat path does the rest).
- `answer.py`: the chat path's deltas -> the message body, or Anthropic's stream events.
- `errors.py`: errors in Anthropic's shape. `routes.py`: the two routes.
"""
