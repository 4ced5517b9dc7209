"""A small Python client for `tandem.v1.GenerationService`.

    from frontend_svc.client import TandemClient
    with TandemClient("localhost:50050") as client:
        for response in client.generate("Once upon a time", max_tokens=32, temperature=0):
            print(response.text, end="", flush=True)

`generate` takes exactly one of a text prompt, `token_ids=[...]` or `chat=[{"role", "content"}, ...]`,
and sampling options by their `tandem.v1.SamplingParams` names (`stop` may be a string). It returns
the server stream: an iterator of `GenerateResponse` (cancel it with `.cancel()`). `AsyncTandemClient`
is the same over grpc.aio. Only grpc and the generated protos are imported (no tokenizer, no torch).

Security: `ssl_ca_certs=` (verify the server; system roots when only `tls=True`), `ssl_certfile=` +
`ssl_keyfile=` (a client certificate for mutual TLS) and `api_key=` (sent as `authorization: Bearer`
on every call).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc as pb_grpc

ChatMessages = Sequence[Mapping[str, str]]


def channel_credentials(ssl_ca_certs: str | None = None, ssl_certfile: str | None = None,
                        ssl_keyfile: str | None = None) -> grpc.ChannelCredentials:
    """TLS credentials from PEM files (None: the system's roots / no client certificate)."""
    def read(path: str | None) -> bytes | None:
        return Path(path).read_bytes() if path else None

    return grpc.ssl_channel_credentials(read(ssl_ca_certs), read(ssl_keyfile), read(ssl_certfile))


def _security(kwargs: dict[str, Any]) -> tuple[grpc.ChannelCredentials | None, tuple[tuple[str, str], ...]]:
    """(channel credentials or None, call metadata) from a client's security keyword arguments."""
    files = {k: kwargs.pop(k, None) for k in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")}
    tls = kwargs.pop("tls", False) or any(files.values())
    api_key = kwargs.pop("api_key", None)
    if kwargs:
        raise TypeError(f"unknown client options: {', '.join(kwargs)}")
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    return (channel_credentials(**files) if tls else None), metadata


def sampling_params(**options: Any) -> pb.SamplingParams:
    """`tandem.v1.SamplingParams` from keyword options; None values are left unset."""
    options = {k: v for k, v in options.items() if v is not None}
    stop = options.get("stop")
    if isinstance(stop, str):
        options["stop"] = [stop]
    return pb.SamplingParams(**options)


def chat_pb(messages: ChatMessages, add_generation_prompt: bool = True) -> pb.Chat:
    return pb.Chat(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages],
                   add_generation_prompt=add_generation_prompt)


def generate_request(
    prompt: str | None = None,
    *,
    token_ids: Sequence[int] | None = None,
    chat: ChatMessages | None = None,
    request_id: str = "",
    priority: int = 0,
    lora_name: str = "",
    **sampling: Any,
) -> pb.GenerateRequest:
    """A GenerateRequest; exactly one of `prompt`, `token_ids`, `chat` must be given; `lora_name`: the
    LoRA adapter to run under ("" = the base model)."""
    given = [x is not None for x in (prompt, token_ids, chat)]
    if sum(given) != 1:
        raise ValueError("pass exactly one of prompt, token_ids or chat")
    request = pb.GenerateRequest(request_id=request_id, priority=priority, lora_name=lora_name,
                                 sampling_params=sampling_params(**sampling))
    if prompt is not None:
        request.text = prompt
    elif token_ids is not None:
        request.token_ids.ids.extend(token_ids)
    else:
        request.chat.CopyFrom(chat_pb(chat or []))
    return request


def tokenize_request(text: str | None = None, chat: ChatMessages | None = None,
                     add_special_tokens: bool | None = None) -> pb.TokenizeRequest:
    if (text is None) == (chat is None):
        raise ValueError("pass exactly one of text or chat")
    request = pb.TokenizeRequest()
    if text is not None:
        request.text = text
    else:
        request.chat.CopyFrom(chat_pb(chat or []))
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    return request


class TandemClient:
    """Blocking client over one channel; use as a context manager or call `close()`.

    Options: `tls`, `ssl_ca_certs`, `ssl_certfile`, `ssl_keyfile`, `api_key` (see the module doc)."""

    def __init__(self, address: str = "localhost:50050", *, channel: grpc.Channel | None = None,
                 **security: Any) -> None:
        credentials, self.metadata = _security(security)
        if channel is None:
            channel = (grpc.secure_channel(address, credentials) if credentials is not None
                       else grpc.insecure_channel(address))
        self.channel = channel
        self.stub = pb_grpc.GenerationServiceStub(self.channel)

    def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                 **kwargs: Any) -> Iterator[pb.GenerateResponse]:
        """Stream responses; kwargs: token_ids, chat, request_id, priority and sampling options."""
        return self.stub.Generate(generate_request(prompt, **kwargs), timeout=timeout,  # type: ignore[no-any-return]
                                  metadata=self.metadata)

    def tokenize(self, text: str | None = None, *, chat: ChatMessages | None = None,
                 add_special_tokens: bool | None = None, timeout: float | None = None) -> list[int]:
        response = self.stub.Tokenize(tokenize_request(text, chat, add_special_tokens), timeout=timeout,
                                      metadata=self.metadata)
        return list(response.token_ids)

    def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool | None = None,
                   timeout: float | None = None) -> str:
        request = pb.DetokenizeRequest(token_ids=token_ids)
        if skip_special_tokens is not None:
            request.skip_special_tokens = skip_special_tokens
        return str(self.stub.Detokenize(request, timeout=timeout, metadata=self.metadata).text)

    def model_info(self, timeout: float | None = None) -> pb.GetModelInfoResponse:
        info: pb.GetModelInfoResponse = self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout,
                                                                metadata=self.metadata)
        return info

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> TandemClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncTandemClient:
    """The same over grpc.aio: `async for response in client.generate(...)`."""

    def __init__(self, address: str = "localhost:50050", *, channel: grpc.aio.Channel | None = None,
                 **security: Any) -> None:
        credentials, self.metadata = _security(security)
        if channel is None:
            channel = (grpc.aio.secure_channel(address, credentials) if credentials is not None
                       else grpc.aio.insecure_channel(address))
        self.channel = channel
        self.stub = pb_grpc.GenerationServiceStub(self.channel)

    def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs: Any) -> Any:
        """A grpc.aio stream call: iterate it with `async for`; `.cancel()` stops it."""
        return self.stub.Generate(generate_request(prompt, **kwargs), timeout=timeout, metadata=self.metadata)

    async def tokenize(self, text: str | None = None, *, chat: ChatMessages | None = None,
                       add_special_tokens: bool | None = None, timeout: float | None = None) -> list[int]:
        response = await self.stub.Tokenize(tokenize_request(text, chat, add_special_tokens), timeout=timeout,
                                            metadata=self.metadata)
        return list(response.token_ids)

    async def model_info(self, timeout: float | None = None) -> pb.GetModelInfoResponse:
        info: pb.GetModelInfoResponse = await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout,
                                                                      metadata=self.metadata)
        return info

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncTandemClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def collect(responses: Iterator[pb.GenerateResponse]) -> dict[int, dict[str, Any]]:
    """Fold a response stream into {index: {"text", "token_ids", "finish_reason", "usage", ...}}."""
    out: dict[int, dict[str, Any]] = {}
    for r in responses:
        entry = out.setdefault(r.index, {"text": "", "token_ids": [], "finish_reason": 0, "usage": None,
                                         "stop_reason": None, "num_responses": 0})
        entry["text"] += r.text
        entry["token_ids"].extend(r.token_ids)
        entry["num_responses"] += 1
        if r.finish_reason:
            entry["finish_reason"] = r.finish_reason
            entry["usage"] = r.usage
            kind = r.WhichOneof("stop_reason")
            entry["stop_reason"] = getattr(r, kind) if kind else None
    return out
