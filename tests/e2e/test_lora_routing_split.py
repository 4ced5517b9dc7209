"""LoRA adapters across several engines and frontends, over real processes: two engines serving the same
adapters (--lora-modules x, y: the same files, so the same fingerprints), and two cache-aware frontends
(A, B) in front of both, with VLLM_ALLOW_RUNTIME_LORA_UPDATING.

- Cache-aware routing is exact per adapter: a prompt's repeat on the same adapter, through either
  frontend, runs on the engine that cached it (its `cached_tokens` are every full block of the prompt but
  the last, as the engine recomputes one token; a repeat on the other engine would find none: the idle
  engines' tie would rotate), while the same prompt on another adapter or the base model finds nothing.
- An adapter loaded through A is served by B without B reconnecting (the engines' WatchLoraAdapters
  streams): it appears in B's /v1/models, B's completions on it equal PEFT's, and once A unloads it B
  answers 404 model_not_found.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx2
import pytest

from tests.e2e.conftest import Cluster, engine_service, free_port, frontend_service, wait_until
from tests.engine.lora_support import ALL_MODULES, make_adapter, make_prompts, peft_greedy
from tests.support import Service

pytestmark = pytest.mark.slow
BLOCK = 16
PROMPT_TOKENS = 40  # two full blocks (the engine reuses 32 tokens: (40 - 1) // 16 blocks)
MAX_TOKENS = 4
LORA_FLAGS = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "4",
              "--block-size", str(BLOCK))


@dataclass
class Frontend:
    service: Service
    url: str
    metrics_url: str

    def complete(self, model: str, prompt: list[int]) -> httpx2.Response:
        body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        return httpx2.post(f"{self.url}/v1/completions", json=body, timeout=60)

    def cached_tokens(self, model: str, prompt: list[int]) -> int:
        response = self.complete(model, prompt)
        assert response.status_code == 200, response.text
        return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    def models(self) -> list[str]:
        return [c["id"] for c in httpx2.get(f"{self.url}/v1/models", timeout=10).json()["data"]]

    def cached_blocks(self) -> float:
        """Blocks this frontend believes its engines hold, all engines together (its /metrics)."""
        text = httpx2.get(self.metrics_url, timeout=5).text
        return sum(float(m[1]) for m in re.finditer(r"^tandem_engine_cached_blocks\{[^}]*\} (\S+)$", text, re.M))


@dataclass
class Stack:
    model: Path
    dirs: dict[str, Path]
    a: Frontend
    b: Frontend


@pytest.fixture(scope="module")
def stack(make_model, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    model = make_model("llama")
    root = tmp_path_factory.mktemp("routing-adapters")
    dirs = {"x": make_adapter(model, root / "x", rank=8, alpha=16, targets=ALL_MODULES, seed=81),
            "y": make_adapter(model, root / "y", rank=4, alpha=8, targets=("q_proj", "v_proj"), seed=82),
            "z": make_adapter(model, root / "z", rank=2, alpha=4, targets=("o_proj", "down_proj"), seed=83)}
    logs = tmp_path_factory.mktemp("lora-routing-logs")
    modules = ("--lora-modules", f"x={dirs['x']}", f"y={dirs['y']}")
    engines = [engine_service(model, free_port(), logs, *LORA_FLAGS, *modules) for _ in range(2)]
    ports = [e.port for e in engines]
    services: list[Service] = list(engines)
    frontends = []
    with pytest.MonkeyPatch.context() as env:  # the frontends' environment (their processes copy it at start)
        env.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
        try:
            for engine in engines:
                engine.start()
            for _ in range(2):
                http_port, metrics_port = free_port(), free_port()
                service = frontend_service(model, ports, free_port(), logs, "--http-port", str(http_port),
                                           "--metrics-port", str(metrics_port), "--routing", "cache-aware")
                services.append(service.start())
                frontends.append(Frontend(service, f"http://127.0.0.1:{http_port}",
                                          f"http://127.0.0.1:{metrics_port}/metrics"))
            for service in services:
                service.wait_serving()
            for f in frontends:
                wait_until(lambda f=f: httpx2.get(f"{f.url}/health", timeout=2).status_code == 200, 30, "/health 200")
                wait_until(lambda f=f: Cluster.model_info(f.service).num_ready_engines == 2, 30,
                           f"{f.url} routing to both engines")
                assert f.models()[1:] == ["x", "y"]
            yield Stack(model, dirs, *frontends)
        finally:
            for service in reversed(services):
                service.stop()


def test_a_repeat_on_the_same_adapter_runs_where_it_is_cached_and_other_adapters_find_nothing(stack: Stack) -> None:
    for i, prompt in enumerate(make_prompts(84, 4, 500, lo=PROMPT_TOKENS, hi=PROMPT_TOKENS)):
        first, second = (stack.a, stack.b) if i % 2 == 0 else (stack.b, stack.a)
        seen = [f.cached_blocks() for f in (first, second)]
        assert first.cached_tokens("x", prompt) == 0
        for f, before in zip((first, second), seen, strict=True):  # both frontends follow the engines' events
            wait_until(lambda f=f, before=before: f.cached_blocks() >= before + 2, 10, "the new blocks in the view")
        assert second.cached_tokens("x", prompt) == 32, f"prompt {i}: the repeat ran on the other engine"
        assert first.cached_tokens("x", prompt) == 32
        assert first.cached_tokens("y", prompt) == 0  # another adapter's KV is never shared
        assert second.cached_tokens(stack.model.name, prompt) == 0  # nor the base model's


def test_an_adapter_loaded_through_one_frontend_is_served_by_the_other(stack: Stack) -> None:
    prompt = make_prompts(85, 1, 500, lo=12, hi=12)[0]
    gone = stack.b.complete("z", prompt)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    load = httpx2.post(f"{stack.a.url}/v1/load_lora_adapter", json={"lora_name": "z", "lora_path": str(stack.dirs["z"])},
                       timeout=60)
    assert load.status_code == 200, load.text
    start = time.monotonic()
    wait_until(lambda: "z" in stack.b.models(), 10, "frontend B serving the adapter frontend A loaded")
    learned_s = time.monotonic() - start
    print(f"frontend B listed the adapter {learned_s * 1000:.0f} ms after A's load returned")
    tokens = peft_greedy(stack.model, stack.dirs["z"], prompt, MAX_TOKENS)[0]
    for _ in range(2):  # whichever engine B picks
        response = stack.b.complete("z", prompt)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["token_ids"] == tokens
    unload = httpx2.post(f"{stack.a.url}/v1/unload_lora_adapter", json={"lora_name": "z"}, timeout=60)
    assert unload.status_code == 200, unload.text
    wait_until(lambda: "z" not in stack.b.models(), 10, "frontend B no longer serving the unloaded adapter")
    gone = stack.b.complete("z", prompt)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
