"""LoRA through the split (engine + frontend processes, the OpenAI HTTP API): `model` = an adapter's name
selects it; concurrent requests of the base model and two adapters equal PEFT's greedy tokens and
logprobs; /v1/models lists the adapters with `parent` = the base; an unknown name is vLLM's 404."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2
import pytest

from tests.e2e.conftest import engine_service, free_port, frontend_service, serving_over_http
from tests.engine.lora_support import ALL_MODULES, make_adapter, make_prompts, peft_greedy

pytestmark = pytest.mark.slow
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def lora_split(make_model, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, dict[str, Path], str]]:
    model = make_model("llama")
    root = tmp_path_factory.mktemp("split-adapters")
    dirs = {"sql": make_adapter(model, root / "sql", rank=8, alpha=16, targets=ALL_MODULES, seed=21),
            "chat-rs": make_adapter(model, root / "chat", rank=4, alpha=4, targets=("q_proj", "v_proj", "down_proj"),
                                    seed=22, rslora=True)}
    logs = tmp_path_factory.mktemp("lora-split-logs")
    engine = engine_service(model, free_port(), logs, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                            "--lora-modules", *(f"{name}={path}" for name, path in dirs.items()))
    http_port = free_port()
    frontend = frontend_service(model, engine.port, free_port(), logs, "--http-port", str(http_port))
    with serving_over_http(engine, frontend, http_port) as url:
        yield url, model, dirs, frontend.address


def _complete(url: str, model: str, prompt: list[int]) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_token_ids": True}
    response = httpx2.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_adapters_by_model_name_equal_peft_in_one_batch(lora_split) -> None:
    url, model_dir, dirs, _ = lora_split
    names = [model_dir.name, "sql", "chat-rs", "sql", model_dir.name, "chat-rs"]
    prompts = make_prompts(11, len(names), 500)
    with ThreadPoolExecutor(len(names)) as pool:
        bodies = list(pool.map(lambda args: _complete(url, *args), zip(names, prompts)))
    for name, prompt, body in zip(names, prompts, bodies):
        tokens, logprobs = peft_greedy(model_dir, dirs.get(name), prompt, MAX_TOKENS)
        choice = body["choices"][0]
        assert body["model"] == name
        assert choice["token_ids"] == tokens, name
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(logprobs, abs=1e-4), name


def test_models_lists_adapters_and_unknown_names_are_404(lora_split) -> None:
    url, model_dir, _, _ = lora_split
    cards = httpx2.get(f"{url}/v1/models", timeout=10).json()["data"]
    assert [(c["id"], c.get("parent")) for c in cards] == [(model_dir.name, None), ("sql", model_dir.name),
                                                           ("chat-rs", model_dir.name)]
    assert httpx2.get(f"{url}/v1/models/sql", timeout=10).json()["parent"] == model_dir.name
    response = httpx2.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "hi", "max_tokens": 1},
                           timeout=10)
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and "`nope`" in error["message"] and error["param"] == "model"


def test_grpc_api_lora_name_selects_the_adapter_and_unknown_is_not_found(lora_split) -> None:
    import grpc

    from frontend_svc.client import TandemClient, collect

    _, model_dir, dirs, address = lora_split
    prompt = make_prompts(12, 1, 500)[0]
    tokens, _ = peft_greedy(model_dir, dirs["chat-rs"], prompt, MAX_TOKENS)
    with TandemClient(address) as client:
        response = collect(client.generate(token_ids=prompt, lora_name="chat-rs", max_tokens=MAX_TOKENS,
                                           temperature=0.0, ignore_eos=True, timeout=60))
        assert response[0]["token_ids"] == tokens
        with pytest.raises(grpc.RpcError) as info:
            collect(client.generate(token_ids=prompt, lora_name="nope", max_tokens=1, timeout=60))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "lora_name" in info.value.details() and "'nope'" in info.value.details()
