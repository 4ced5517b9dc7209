"""A real SMG gateway (PyPI `smg`, Rust) driving prefill/decode disaggregation over two tandem engines.

`smg launch --pd-disaggregation --prefill grpc://P --decode grpc://D`: SMG reads each engine's KV-transfer
fields from GetServerInfo (tandem reports NIXL's handoff protocol, which its GrpcConnector speaks), sends
the prefill leg to P (max_tokens 1, `kv_transfer_params_json` {"do_remote_decode": true}), takes the kept
blocks' handoff from P's `complete`, and sends the client's request to D with it; D pulls the blocks over
PullKvBlocks and generates. Oracle: tandem's own frontend on P alone (one engine), same requests, greedy:
the same text and token counts; D pulled blocks for every request; every block is back on both engines.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
from tandem.vendor.smg import vllm_engine_pb2 as vpb
from tandem.vendor.smg import vllm_engine_pb2_grpc as vpb_grpc

from tests.engine_stream import engine_idle
from tests.realmodel.support import CHAT_QUESTIONS, MAX_TOKENS, Fleet
from tests.realmodel.test_smg_gateway import SMG, Gateway
from tests.support import free_port, metric_value, wait_until

pytestmark = pytest.mark.slow


class PdDeployment:
    def __init__(self, fleet: Fleet, model: Path) -> None:
        def kv(role: str) -> tuple[str, str]:
            return "--kv-transfer-config", json.dumps({"kv_connector": "GrpcConnector", "kv_role": role})

        self.consumer_metrics = free_port()
        # No prefix cache on the producer: the oracle's runs there must not warm the disaggregated prefills.
        self.producer = fleet.engine(model, "--max-model-len", "2048", *kv("kv_producer"), "--no-enable-prefix-caching")
        self.consumer = fleet.engine(model, "--max-model-len", "2048", *kv("kv_consumer"),
                                     "--metrics-port", str(self.consumer_metrics))
        http_port = free_port()
        fleet.frontend(self.producer, "--model", str(model), "--http-port", str(http_port))
        fleet.wait_serving()
        for engine in (self.producer, self.consumer):  # first steps are slow: not inside SMG's 3 s silence bound
            with grpc.insecure_channel(engine.address) as channel:
                warm = vpb.GenerateRequest(request_id="warm-up", tokenized=vpb.TokenizedInput(input_ids=[1, 2, 3]),
                                           sampling_params=vpb.SamplingParams(max_tokens=2))
                list(vpb_grpc.VllmEngineStub(channel).Generate(warm, timeout=120))
        port = free_port()
        gateway = Gateway("smg", [str(SMG), "launch", "--host", "127.0.0.1", "--port", str(port),
                                  "--pd-disaggregation", "--prefill", f"grpc://{self.producer.address}",
                                  "--decode", f"grpc://{self.consumer.address}", "--model-path", str(model),
                                  "--policy", "round_robin", "--prometheus-port", str(free_port()),
                                  # a prefill leg is silent until it completes: SMG's default 3 s bound
                                  # counts a CPU prefill on a busy machine as a wedged worker
                                  "--worker-wedge-secs", "60",
                                  "--log-level", "warn"], port, fleet.logs)
        fleet.start(gateway)
        gateway.wait_ready(model.name, 60)
        self.model = model.name
        self.smg = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300)
        self.tandem = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none", max_retries=0,
                                    timeout=300)

    def pulled_blocks(self) -> float:
        return metric_value(self.consumer_metrics, "tandem_kv_transfer_blocks_pulled_total")


@pytest.fixture(scope="module")
def pd(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdDeployment]:
    assert SMG.exists(), "the smg gateway is not installed (the dev extra pins it; run `make install`)"
    with Fleet(tmp_path_factory.mktemp("smg-pd-logs")) as fleet:
        yield PdDeployment(fleet, smollm2_dir)


def test_smg_drives_prefill_and_decode_and_the_text_is_one_engine_s(pd: PdDeployment) -> None:
    for question in CHAT_QUESTIONS:
        params = {"model": pd.model, "messages": [{"role": "user", "content": question}], "temperature": 0,
                  "max_tokens": MAX_TOKENS}
        ours = pd.tandem.chat.completions.create(**params)  # type: ignore[call-overload]
        before = pd.pulled_blocks()
        theirs = pd.smg.chat.completions.create(**params)  # type: ignore[call-overload]
        assert pd.pulled_blocks() > before, "the decode engine recomputed the prompt instead of pulling it"
        assert theirs.choices[0].message.content == ours.choices[0].message.content, question
        assert theirs.usage.completion_tokens == ours.usage.completion_tokens
        streamed = pd.smg.chat.completions.create(**params, stream=True)  # type: ignore[call-overload]
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
            ours.choices[0].message.content
    for engine in (pd.producer, pd.consumer):  # the kept blocks were pulled (or released): all back
        wait_until(lambda e=engine: engine_idle(e.address), 15, f"{engine.address} idle")
