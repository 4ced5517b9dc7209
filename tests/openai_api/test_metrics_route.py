"""`GET /metrics` on the OpenAI HTTP port (where vLLM serves Prometheus), beside `--metrics-port`: the same
registry, so the same series with the same values; guarded by the API key like every route but /health and
/ping (the unauthenticated scrape is --metrics-port's); 404 when metrics are off."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx2
from prometheus_client.parser import text_string_to_metric_families

from frontend_svc.telemetry.service import FrontendTelemetry
from tests.openai_api.conftest import HttpStack
from tests.support import LoopThread, free_port

KEY = "sk-metrics-test-1"


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_on_the_api_port_are_the_metrics_port_series(loop: LoopThread, tokenizer: Any,
                                                             tiny_model_dir: Path) -> None:
    port = free_port()
    telemetry = FrontendTelemetry.from_env("tiny", port, "127.0.0.1")
    stack = HttpStack(loop, tokenizer, tiny_model_dir, telemetry=telemetry, api_keys=(KEY,))
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        stack.wait_http_ready()
        for route, body in (("/v1/responses", {"input": "Hi", "max_output_tokens": 2}),
                            ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                            ("/v1/messages", {"model": stack.frontend.config.model_name, "messages": [{"role": "user", "content": "Hi"}],
                                              "max_tokens": 2})):
            assert httpx2.post(f"{stack.url}{route}", json=body, headers=auth, timeout=30).status_code == 200
        assert httpx2.get(f"{stack.url}/metrics", timeout=10).status_code == 401
        api = httpx2.get(f"{stack.url}/metrics", headers=auth, timeout=10)
        own = httpx2.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
        assert api.status_code == own.status_code == 200
        assert api.headers["content-type"].startswith("text/plain")
        ours, theirs = samples(api.text), samples(own.text)
        assert set(ours) == set(theirs)
        success = [(k, v) for k, v in ours.items() if k[0] == "tandem_request_success_total"]
        assert sum(v for _, v in success) == 3  # every call, the Responses and Messages ones included
        assert ours[("tandem_request_success_total", (("finished_reason", "length"), ("model_name", "tiny")))] == 3
    finally:
        stack.close()
        telemetry.shutdown()


def test_metrics_off_is_404(loop: LoopThread, tokenizer: Any, tiny_model_dir: Path) -> None:
    stack = HttpStack(loop, tokenizer, tiny_model_dir)
    try:
        stack.wait_http_ready()
        got = httpx2.get(f"{stack.url}/metrics", timeout=10)
        assert got.status_code == 404 and "metrics are off" in got.json()["error"]["message"]
    finally:
        stack.close()
