"""Prefill/decode disaggregation driven as llm-d's routing sidecar drives vLLM: two servers (each a frontend on
one engine, as a pod would be), the prefill one on a `kv_producer` engine, the decode one on a `kv_consumer`.
The "sidecar" here does what llm-d's nixlv2 connector does over HTTP: the client's body to the prefill server
with max_tokens 1, stream false and kv_transfer_params {do_remote_decode: true, the rest null}; the
response's kv_transfer_params into the client's original body, sent to the decode server, streamed or not.
The oracle is the same bodies through the prefill server alone, without kv_transfer_params (one engine):
the same text, token ids and logprobs; the consumer pulled blocks; every block is back on both engines.
The consumer's metrics carry vLLM's gauge names, which llm-d's endpoint picker reads."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from tests.e2e.conftest import engine_service, free_port, frontend_service, wait_until
from tests.engine_stream import engine_idle
from tests.support import metric_value

pytestmark = pytest.mark.slow
PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
           "remote_host": None, "remote_port": None}


class Pods:
    def __init__(self, model: Path, logs: Path) -> None:
        self.model = model.name  # the served name

        def engine(role: str, *flags: str) -> Any:
            kv = json.dumps({"kv_connector": "GrpcConnector", "kv_role": role})
            metrics = free_port()
            return engine_service(model, free_port(), logs, "--metrics-port", str(metrics), "--kv-transfer-config",
                                  kv, *flags), metrics

        # No prefix cache on the producer: the oracle's runs there must not warm the disaggregated prefills.
        (self.producer, _), (self.consumer, self.consumer_metrics) = \
            engine("kv_producer", "--no-enable-prefix-caching"), engine("kv_consumer")
        self.http = {"prefill": free_port(), "decode": free_port()}
        self.frontends = [frontend_service(model, e.port, free_port(), logs, "--http-port", str(self.http[name]))
                          for name, e in (("prefill", self.producer), ("decode", self.consumer))]
        self.services = [self.producer, self.consumer, *self.frontends]
        for service in self.services:
            service.start()
        for service in self.services:
            service.wait_serving()
        for port in self.http.values():
            wait_until(lambda p=port: httpx2.get(f"http://127.0.0.1:{p}/health", timeout=2).status_code == 200, 30,
                       "/health 200")

    def post(self, pod: str, route: str, body: dict[str, Any]) -> Any:
        url = f"http://127.0.0.1:{self.http[pod]}{route}"
        body = {**body, "model": self.model}
        if not body.get("stream"):
            response = httpx2.post(url, json=body, timeout=120)
            assert response.status_code == 200, response.text
            return response.json()
        with httpx2.stream("POST", url, json=body, timeout=120) as response:
            assert response.status_code == 200, response.read()
            return [json.loads(line[6:]) for line in response.iter_lines()
                    if line.startswith("data: ") and line != "data: [DONE]"]

    def sidecar(self, route: str, body: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """llm-d's nixlv2 flow: (the decode server's answer, the prefill's kv_transfer_params)."""
        prefill = copy.deepcopy(body)
        prefill.pop("stream_options", None)
        prefill.update(kv_transfer_params=PREFILL, stream=False, max_tokens=1)
        kept = self.post("prefill", route, prefill)["kv_transfer_params"]
        return self.post("decode", route, {**body, "kv_transfer_params": kept}), kept

    def metrics(self) -> str:
        return httpx2.get(f"http://127.0.0.1:{self.consumer_metrics}/metrics", timeout=5).text

    def pulled(self) -> float:
        return metric_value(self.consumer_metrics, "tandem_kv_transfer_blocks_pulled_total")

    def close(self) -> None:
        for service in reversed(self.services):
            service.stop()


@pytest.fixture(scope="module")
def pods(make_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pods]:
    cluster = Pods(make_model("llama"), tmp_path_factory.mktemp("llmd-logs"))
    try:
        yield cluster
    finally:
        cluster.close()


def _completion(answer: dict[str, Any]) -> tuple[str, list[int], list[float]]:
    choice = answer["choices"][0]
    return choice["text"], choice["token_ids"], choice["logprobs"]["token_logprobs"]


def test_completions_through_the_sidecar_flow_equal_one_engine(pods: Pods) -> None:
    prompts = [[1, *range(40 + 7 * i, 40 + 7 * i + 37 + 5 * i)] for i in range(3)]  # several blocks each
    for prompt in prompts:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "logprobs": 1, "return_token_ids": True}
        before = pods.pulled()
        disaggregated, kept = pods.sidecar("/v1/completions", body)
        assert kept["do_remote_prefill"] and kept["remote_port"] == pods.producer.port
        assert len(kept["remote_block_ids"]) >= 2 and kept["remote_num_tokens"] == len(prompt)
        assert pods.pulled() > before  # the decode engine pulled, it did not recompute
        alone = pods.post("prefill", "/v1/completions", body)
        text, ids, logprobs = _completion(disaggregated)
        assert (text, ids) == _completion(alone)[:2]
        assert logprobs == pytest.approx(_completion(alone)[2], abs=1e-4)
        assert disaggregated["usage"] == alone["usage"] and disaggregated["kv_transfer_params"] is None
    for engine in (pods.producer, pods.consumer):  # every KV block back, the producer's leases ended by the pulls
        wait_until(lambda e=engine: engine_idle(e.address), 10, f"{engine.address} idle")


def test_streamed_chat_through_the_sidecar_flow_equals_one_engine(pods: Pods) -> None:
    body = {"messages": [{"role": "user", "content": "Tell me about the sea and the old ships. " * 3}],
            "max_tokens": 10, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    chunks, kept = pods.sidecar("/v1/chat/completions", body)
    assert kept["do_remote_prefill"]
    alone = pods.post("prefill", "/v1/chat/completions", body)

    def text(stream: list[dict[str, Any]]) -> str:
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in stream if c["choices"])

    assert text(chunks) == text(alone) and chunks[-1]["usage"] == alone[-1]["usage"]
    wait_until(lambda: engine_idle(pods.producer.address), 10, "the producer idle")


def test_the_consumer_exports_the_gauges_llm_d_reads_under_vllms_names(pods: Pods) -> None:
    text = pods.metrics()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert any(line.startswith(name + "{") for line in text.splitlines()), name
    info = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
    assert 'block_size="16"' in info and 'num_gpu_blocks="' in info and info.endswith(" 1.0")
