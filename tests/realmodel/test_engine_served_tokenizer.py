"""A frontend started with only --engine serves SmolLM2-135M-Instruct exactly as one started with --model.

The session's engine on the converted Hugging Face directory (`smollm2_dir`; conftest.py `smollm2_pair`),
two frontends of this module's in front of it: one
with --model on the same directory, one without (it fetches tokenizer.json, tokenizer_config.json with
the chat template, generation_config.json and config.json from the engine's GetTokenizer). Both must
render chats, tokenize, stream text and describe the model identically. (An engine serving the .gguf file
serves the file's metadata instead: test_served_real_model.py checks a frontend without --model there.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc as pb_grpc

from tests.realmodel.support import CHAT_QUESTIONS, MAX_TOKENS, MULTIBYTE_QUESTION, Fleet, SharedPair
from tests.support import Service

pytestmark = pytest.mark.slow

RPC_TIMEOUT_S = 120.0


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
def pair(smollm2_pair: SharedPair, smollm2_dir: Path,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Api, Api]]:
    """Two frontends of this module's own on the session's serving engine (conftest.py `smollm2_pair`)."""
    with Fleet(tmp_path_factory.mktemp("served-tokenizer")) as fleet:
        # the frontend without --model fetches the tokenizer from the engine, which serves already
        with_model = fleet.frontend(smollm2_pair.engine, "--model", str(smollm2_dir))
        without = fleet.frontend(smollm2_pair.engine)
        fleet.wait_serving()
        yield Api(with_model), Api(without)


def test_chat_text_tokens_and_model_info_equal_those_of_a_frontend_with_the_model(pair: tuple[Api, Api]) -> None:
    with_model, without = pair
    for question in (*CHAT_QUESTIONS[:2], MULTIBYTE_QUESTION):
        assert without.chat(question) == with_model.chat(question), question
    assert with_model.chat(CHAT_QUESTIONS[0])[0] == "The capital of France is Paris."
    text = "Hello world! Café, niño, 中国 and 12345."
    assert without.tokenize(text) == with_model.tokenize(text)
    assert without.info() == with_model.info()
    assert without.info().model_name == "SmolLM2-135M-Instruct" and without.info().has_chat_template
