"""A frontend started with only --engine serves SmolLM2-135M-Instruct exactly as one started with --model.

One engine on the converted Hugging Face directory (`smollm2_dir`), two frontends in front of it: one
with --model on the same directory, one without (it fetches tokenizer.json, tokenizer_config.json with
the chat template, generation_config.json and config.json from the engine's GetTokenizer). Both must
render chats, tokenize, stream text and describe the model identically. (An engine serving the .gguf file
serves the file's metadata instead: test_served_real_model.py checks a frontend without --model there.)
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc as pb_grpc

from tests.realmodel.support import CHAT_QUESTIONS, MAX_TOKENS, MULTIBYTE_QUESTION, START_TIMEOUT_S
from tests.support import Service, free_port

pytestmark = pytest.mark.slow

RPC_TIMEOUT_S = 120.0
ENGINE_FLAGS = ("--host", "127.0.0.1", "--dtype", "float32", "--metrics-port", "0", "--num-gpu-blocks-override", "32")


def engine(model: Path, logs: Path) -> Service:
    port = free_port()
    return Service("engine", [sys.executable, "-m", "engine_svc.server_cli", "--model", str(model),
                              "--port", str(port), *ENGINE_FLAGS], port, logs).start()


def frontend(engine_address: str, logs: Path, *model: str) -> Service:
    port = free_port()
    return Service("frontend", [sys.executable, "-m", "frontend_svc.cli", *model, "--engine", engine_address,
                                "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0"], port, logs).start()


class Api:
    def __init__(self, service: Service) -> None:
        self.channel = grpc.insecure_channel(service.address)
        self.stub = pb_grpc.GenerationServiceStub(self.channel)

    def chat(self, question: str) -> tuple[str, list[int]]:
        request = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=question)],
                                                  add_generation_prompt=True),
                                     sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
        responses = list(self.stub.Generate(request, timeout=RPC_TIMEOUT_S))
        return "".join(r.text for r in responses), [t for r in responses for t in r.token_ids]

    def info(self) -> pb.GetModelInfoResponse:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=RPC_TIMEOUT_S)

    def tokenize(self, text: str) -> list[int]:
        return list(self.stub.Tokenize(pb.TokenizeRequest(text=text), timeout=RPC_TIMEOUT_S).token_ids)


@pytest.fixture(scope="module")
def pair(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Api, Api]]:
    logs = tmp_path_factory.mktemp("served-tokenizer")
    served = engine(smollm2_dir, logs)
    services = [served]
    try:
        served.wait_serving(START_TIMEOUT_S)
        with_model = frontend(served.address, logs, "--model", str(smollm2_dir))
        without = frontend(served.address, logs)
        services += [with_model, without]
        for service in (with_model, without):
            service.wait_serving(START_TIMEOUT_S)
        yield Api(with_model), Api(without)
    finally:
        for service in reversed(services):
            service.stop()


def test_chat_text_tokens_and_model_info_equal_those_of_a_frontend_with_the_model(pair: tuple[Api, Api]) -> None:
    with_model, without = pair
    for question in (*CHAT_QUESTIONS[:2], MULTIBYTE_QUESTION):
        assert without.chat(question) == with_model.chat(question), question
    assert with_model.chat(CHAT_QUESTIONS[0])[0] == "The capital of France is Paris."
    text = "Hello world! Café, niño, 中国 and 12345."
    assert without.tokenize(text) == with_model.tokenize(text)
    assert without.info() == with_model.info()
    assert without.info().model_name == "SmolLM2-135M-Instruct" and without.info().has_chat_template
