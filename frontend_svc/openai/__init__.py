"""An OpenAI-compatible HTTP API (`/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`)
served by the frontend beside the gRPC API, on the same generation path (docs/openai.md).

- `protocol.py`: the request and response bodies, as pydantic models (validated by the library).
- `convert.py`: an OpenAI request -> prompts + `SamplingParams`; `CompletionDelta`s -> OpenAI bodies.
- `structured.py`: response_format / vLLM's structured_outputs -> the engine's output constraint.
- `tools.py`, `tool_parsers.py`: tool calling (tool_choice, tool definitions in the chat template,
  tool calls out of the text, streamed as OpenAI's deltas).
- `errors.py`: validation and service errors -> OpenAI's JSON error shape and HTTP status.
- `sse.py`: Server-Sent Events framing and a streaming response that always closes its generation.
- `raw_body.py`: a streamed body's chunks written straight to the connection (below Starlette's and
  uvicorn's `send`), with uvicorn's flow control; offered by `edge.py` to every request's scope.
- `app.py`: the Starlette routes (auth, body limit, admission, streaming).
- `serve.py`: uvicorn on the frontend's event loop, started and stopped with the gRPC server.
"""
