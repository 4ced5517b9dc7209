"""SmolLM2-135M-Instruct through the split: `tandem-engine --model X.gguf` + `tandem-frontend --model X.gguf`
(config, weights and tokenizer straight from the GGUF file), driven over the public gRPC API and
checked against transformers on the converted directory.

The engine runs with a KV cache of 32 blocks x 16 = 512 tokens, smaller than the model's context (8192):
it must serve and advertise max_model_len 512, so the frontend's length check is exact.
One engine + frontend pair serves the whole module; one test adds a frontend with only --engine, whose
tokenizer comes from the engine (GetTokenizer: the GGUF file's metadata without its tensors).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from tandem.engine.v1 import engine_core_pb2 as epb
from tandem.engine.v1 import engine_core_pb2_grpc as epb_grpc
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc as pb_grpc

from tests.realmodel.support import CHAT_QUESTIONS, MAX_TOKENS, MULTIBYTE_QUESTION, Fleet
from tests.support import Service

pytestmark = pytest.mark.slow

KV_BLOCKS, BLOCK_SIZE = 32, 16
KV_TOKENS = KV_BLOCKS * BLOCK_SIZE
RPC_TIMEOUT_S = 120.0
REPLACEMENT = "\ufffd"


@dataclass
class Split:
    engine: Service
    frontend: Service
    channel: grpc.Channel = field(init=False)

    def __post_init__(self) -> None:
        self.channel = grpc.insecure_channel(self.frontend.address)
        self.api = pb_grpc.GenerationServiceStub(self.channel)


@pytest.fixture(scope="module")
def split(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Split]:
    with Fleet(tmp_path_factory.mktemp("realmodel-split")) as fleet:
        engine = fleet.engine(smollm2_gguf, "--block-size", str(BLOCK_SIZE),
                              "--num-gpu-blocks-override", str(KV_BLOCKS))
        pair = Split(engine, fleet.frontend(engine, "--model", str(smollm2_gguf)))
        try:
            fleet.wait_serving()
            yield pair
        finally:
            pair.channel.close()


@dataclass
class Streamed:
    deltas: list[str]
    token_ids: list[int]
    last: pb.GenerateResponse
    logprobs: list[pb.TokenLogprobs]

    @property
    def text(self) -> str:
        return "".join(self.deltas)


def generate(split: Split, request: pb.GenerateRequest) -> Streamed:
    deltas, ids, logprobs = [], [], []
    last = None
    for response in split.api.Generate(request, timeout=RPC_TIMEOUT_S):
        deltas.append(response.text)
        ids.extend(response.token_ids)
        logprobs.extend(response.logprobs)
        last = response
    assert last is not None and last.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    return Streamed(deltas, ids, last, logprobs)


def chat_request(question: str, **params: object) -> pb.GenerateRequest:
    messages = [pb.ChatMessage(role="user", content=question)]
    return pb.GenerateRequest(chat=pb.Chat(messages=messages, add_generation_prompt=True),
                              sampling_params=pb.SamplingParams(temperature=0.0, **params))


def test_greedy_chat_through_the_split_equals_transformers(split: Split, chat_ids, hf_greedy, hf_tokenizer) -> None:
    for question in CHAT_QUESTIONS[:3]:
        out = generate(split, chat_request(question, max_tokens=MAX_TOKENS))
        expected = hf_greedy(chat_ids(question))
        assert out.token_ids == expected, question
        assert out.text == hf_tokenizer.decode(expected, skip_special_tokens=True)
        assert out.last.usage.prompt_tokens == len(chat_ids(question))
        assert out.last.usage.completion_tokens == len(expected)
    first = generate(split, chat_request(CHAT_QUESTIONS[0], max_tokens=MAX_TOKENS))
    assert first.text == "The capital of France is Paris." and first.last.finish_reason == pb.FINISH_REASON_STOP


def test_a_stop_string_on_real_text(split: Split) -> None:
    out = generate(split, chat_request(CHAT_QUESTIONS[0], max_tokens=MAX_TOKENS, stop=["Paris"]))
    assert out.text == "The capital of France is "
    assert out.last.finish_reason == pb.FINISH_REASON_STOP and out.last.stop_string == "Paris"


def test_multibyte_output_streams_without_replacement_characters(split: Split, hf_tokenizer) -> None:
    out = generate(split, chat_request(MULTIBYTE_QUESTION, max_tokens=24))
    assert any(REPLACEMENT in hf_tokenizer.decode([t]) for t in out.token_ids), "no character was split"
    assert all(REPLACEMENT not in delta for delta in out.deltas)
    assert out.text == hf_tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert "中国" in out.text


def test_tokenize_detokenize_and_model_info_match_transformers(split: Split, chat_ids, hf_tokenizer) -> None:
    text = "Hello world! Café, niño, 中国 and 12345."
    tokenized = split.api.Tokenize(pb.TokenizeRequest(text=text), timeout=RPC_TIMEOUT_S)
    assert list(tokenized.token_ids) == hf_tokenizer(text)["input_ids"]
    assert tokenized.count == len(tokenized.token_ids) and tokenized.max_model_len == KV_TOKENS
    messages = [pb.ChatMessage(role="user", content=CHAT_QUESTIONS[0])]
    chat = split.api.Tokenize(pb.TokenizeRequest(chat=pb.Chat(messages=messages, add_generation_prompt=True)),
                              timeout=RPC_TIMEOUT_S)
    assert list(chat.token_ids) == chat_ids(CHAT_QUESTIONS[0])
    for skip in (True, False):
        detok = split.api.Detokenize(pb.DetokenizeRequest(token_ids=chat.token_ids, skip_special_tokens=skip),
                                     timeout=RPC_TIMEOUT_S)
        assert detok.text == hf_tokenizer.decode(list(chat.token_ids), skip_special_tokens=skip)
    info = split.api.GetModelInfo(pb.GetModelInfoRequest(), timeout=RPC_TIMEOUT_S)
    assert info.model_name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert info.vocab_size == len(hf_tokenizer) == 49152
    assert list(info.eos_token_ids) == [hf_tokenizer.eos_token_id] == [2]
    assert info.bos_token_id == hf_tokenizer.bos_token_id and info.has_chat_template


def test_logprobs_match_transformers_log_softmax(split: Split, chat_ids, hf_logprobs) -> None:
    prompt = chat_ids(CHAT_QUESTIONS[1])
    out = generate(split, pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling_params=pb.SamplingParams(
        temperature=0.0, max_tokens=8, logprobs=5)))
    reference = hf_logprobs(prompt + out.token_ids)
    assert len(out.logprobs) == len(out.token_ids) == 8
    for i, entry in enumerate(out.logprobs):
        row = reference[len(prompt) + i - 1]
        assert entry.token_id == out.token_ids[i] and entry.rank == 1
        assert entry.logprob == pytest.approx(float(row[entry.token_id]), abs=2e-3)
        assert [t.token_id for t in entry.top_logprobs] == row.topk(5).indices.tolist()


def test_max_model_len_is_what_the_kv_cache_holds(split: Split) -> None:
    """Regression (issue 12): the engine advertises the context its KV cache holds, not the model's, and
    the frontend's length check is exact at that limit."""
    with grpc.insecure_channel(split.engine.address) as channel:
        info = epb_grpc.EngineCoreServiceStub(channel).GetEngineInfo(epb.GetEngineInfoRequest(), timeout=30)
    assert info.max_model_len == KV_TOKENS and info.num_blocks == KV_BLOCKS
    assert split.api.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).max_model_len == KV_TOKENS
    prompt = [(7 * i) % 40000 + 100 for i in range(KV_TOKENS - 8)]
    too_long = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                  sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))
    with pytest.raises(grpc.RpcError) as err:
        generate(split, too_long)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"max_model_len ({KV_TOKENS})" in (err.value.details() or "")
    fits = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                              sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    out = generate(split, fits)
    assert len(out.token_ids) == 8 and out.last.finish_reason == pb.FINISH_REASON_LENGTH


def test_a_frontend_without_the_model_serves_the_same_text_from_the_engines_gguf_metadata(
        split: Split, tmp_path: Path) -> None:
    with Fleet(tmp_path) as fleet, grpc.insecure_channel(fleet.frontend(split.engine, name="frontend-no-model")
                                                         .address) as channel:
        fleet.wait_serving()
        api = pb_grpc.GenerationServiceStub(channel)
        for question in CHAT_QUESTIONS[:2]:
            request = chat_request(question, max_tokens=MAX_TOKENS)
            assert "".join(r.text for r in api.Generate(request, timeout=RPC_TIMEOUT_S)) == \
                generate(split, request).text
        info = api.GetModelInfo(pb.GetModelInfoRequest(), timeout=RPC_TIMEOUT_S)
    assert info == split.api.GetModelInfo(pb.GetModelInfoRequest(), timeout=RPC_TIMEOUT_S)
