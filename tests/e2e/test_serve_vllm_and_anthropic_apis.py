"""`tandem serve` answers vLLM's native gRPC API (vllm.Inference / vllm.Control) on its gRPC port and
Anthropic's Messages API on its HTTP port, behind the same API key as its own APIs: greedy text from
vllm.Inference equals tandem.v1's for the same request, the `anthropic` client's message equals the chat
completion of the same messages (whole and streamed), count_tokens equals the prompt length it reports,
and a call without the key is refused by both."""

from __future__ import annotations

import sys
from pathlib import Path

import anthropic
import grpc
import httpx2
import pytest
from tandem.vendor.vllm import control_pb2 as cpb
from tandem.vendor.vllm import control_pb2_grpc as cpb_grpc
from tandem.vendor.vllm import inference_pb2 as ipb
from tandem.vendor.vllm import inference_pb2_grpc as ipb_grpc

from frontend_svc.client import TandemClient, collect
from tests.support import Service, free_port, rpc_error

pytestmark = pytest.mark.slow
KEY = "serve-apis-key-81c2"
PROMPT = "The capital of France is"


def test_serve_answers_both_apis_behind_its_key(tiny_model_dir: Path, tmp_path: Path) -> None:
    port, engine_port, http_port = free_port(), free_port(), free_port()
    serve = Service("serve", [sys.executable, "-m", "entrypoints.serve", "--model", str(tiny_model_dir),
                              "--port", str(port), "--engine-port", str(engine_port), "--http-port", str(http_port),
                              "--api-key", KEY, "--dtype", "float32"], port, tmp_path).start()
    try:
        serve.wait_serving(120)
        auth = (("authorization", f"Bearer {KEY}"),)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            inference = ipb_grpc.InferenceStub(channel)
            request = ipb.GenerateRequest(text=PROMPT, stopping=ipb.StoppingCriteria(max_new_tokens=8, ignore_eos=True),
                                          response=ipb.ResponseOptions(output_token_ids=True))
            parts = [r.outputs for r in inference.GenerateStream(request, metadata=auth, timeout=60)
                     if r.HasField("outputs")]
            info = cpb_grpc.ControlStub(channel).GetServerInfo(cpb.GetServerInfoRequest(), metadata=auth, timeout=10)
            refused = rpc_error(lambda: list(inference.GenerateStream(request, timeout=10)))
        assert refused.code() == grpc.StatusCode.UNAUTHENTICATED
        with TandemClient(f"127.0.0.1:{port}", api_key=KEY) as client:
            want = collect(client.generate(PROMPT, temperature=0, max_tokens=8, ignore_eos=True, timeout=60))[0]
        assert "".join(p.text for p in parts) == want["text"] and [t for p in parts for t in p.token_ids] == \
            want["token_ids"]
        assert parts[-1].finish_info.finish_reason == ipb.FinishInfo.LENGTH and info.max_model_len > 0

        url = f"http://127.0.0.1:{http_port}"
        model = httpx2.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
        name = model["data"][0]["id"]
        c = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=60)
        messages: list[anthropic.types.MessageParam] = [{"role": "user", "content": PROMPT}]
        message = c.messages.create(model=name, messages=messages, max_tokens=6, extra_body={"temperature": 0})
        with c.messages.stream(model=name, messages=messages, max_tokens=6, extra_body={"temperature": 0}) as stream:
            streamed = "".join(stream.text_stream)
        chat = httpx2.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                           json={"messages": messages, "max_tokens": 6, "temperature": 0}).json()
        text = chat["choices"][0]["message"]["content"]
        assert [b.text for b in message.content if b.type == "text"] == [text] and streamed == text
        assert message.usage.input_tokens == chat["usage"]["prompt_tokens"]
        assert c.messages.count_tokens(model=name, messages=messages).input_tokens == message.usage.input_tokens
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
                model=name, messages=messages, max_tokens=2)
    finally:
        code = serve.stop()
    assert code == 0, serve.log()
