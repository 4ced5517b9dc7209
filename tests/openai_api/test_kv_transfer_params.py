"""`kv_transfer_params` on /v1/completions and /v1/chat/completions (openai/kv_transfer.py): P/D driven from
outside, as llm-d's routing sidecar drives vLLM. The prefill body (the sidecar's: max_tokens 1, stream false,
do_remote_decode with nulls) reaches the engine as do_remote_decode and the response names the kept blocks
in vLLM's keys; that object sent back as the decode body's kv_transfer_params reaches the engine as a pull;
bad params are 400s naming the key. Real engines and the pull: tests/e2e/test_pd_llmd.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from tests.openai_api.conftest import HttpStack
from tests.support import LoopThread

SIDECAR_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                   "remote_block_ids": None, "remote_host": None, "remote_port": None}


@pytest.fixture(scope="module")
def stack(loop: LoopThread, tokenizer: Any, tiny_model_dir: Path) -> Iterator[HttpStack]:
    stack = HttpStack(loop, tokenizer, tiny_model_dir)
    stack.fake.kv_role = "kv_producer"
    stack.wait_http_ready()
    yield stack
    stack.close()


def _post(stack: HttpStack, route: str, body: dict[str, Any]) -> httpx2.Response:
    return httpx2.post(f"{stack.url}{route}", json={"model": stack.frontend.model_name, **body}, timeout=30)


@pytest.mark.parametrize("route, prompt", [("/v1/completions", {"prompt": "The quick brown fox"}),
                                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
def test_the_sidecars_prefill_then_decode_reach_the_engine_and_the_response_names_the_blocks(
        stack: HttpStack, route: str, prompt: dict[str, Any]) -> None:
    stack.fake.added.clear()
    prefill = _post(stack, route, {**prompt, "max_tokens": 1, "stream": False, "kv_transfer_params": SIDECAR_PREFILL})
    assert prefill.status_code == 200, prefill.text
    sent, = stack.fake.added
    assert sent.kv_transfer_params.do_remote_decode and not sent.kv_transfer_params.do_remote_prefill
    kept = prefill.json()["kv_transfer_params"]
    assert kept == {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": "",
                    "remote_host": "fake-producer", "remote_port": 0, "remote_request_id": sent.request_id,
                    "remote_block_ids": [], "remote_num_tokens": len(sent.prompt_token_ids)}
    kept["remote_port"] = 4242  # a real producer names its engine port
    decode = _post(stack, route, {**prompt, "max_tokens": 5, "kv_transfer_params": kept})
    assert decode.status_code == 200, decode.text
    assert decode.json()["kv_transfer_params"] is None  # a pull keeps nothing
    pulled = stack.fake.added[1].kv_transfer_params
    assert pulled.do_remote_prefill and not pulled.do_remote_decode
    assert (pulled.remote_host, pulled.remote_port, pulled.remote_request_id) == ("fake-producer", 4242,
                                                                                   sent.request_id)
    assert stack.fake.added[1].prompt_token_ids == sent.prompt_token_ids


def test_without_the_field_the_response_has_it_null_and_the_engine_gets_none(stack: HttpStack) -> None:
    stack.fake.added.clear()
    response = _post(stack, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert response.status_code == 200 and response.json()["kv_transfer_params"] is None
    assert not stack.fake.added[0].HasField("kv_transfer_params")
    # Every key null or false: no direction asked, an ordinary request (as vLLM's connector reads it).
    response = _post(stack, "/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                                 "kv_transfer_params": {**SIDECAR_PREFILL, "do_remote_decode": False}})
    assert response.status_code == 200 and not stack.fake.added[1].HasField("kv_transfer_params")


@pytest.mark.parametrize("body, param", [
    ({"kv_transfer_params": [1]}, "kv_transfer_params"),
    ({"kv_transfer_params": {"do_remote_decode": True, "tp_size": 2}}, "kv_transfer_params.tp_size"),
    ({"kv_transfer_params": {"do_remote_decode": "yes"}}, "kv_transfer_params.do_remote_decode"),
    ({"kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": True}},
     "kv_transfer_params.do_remote_prefill"),
    ({"kv_transfer_params": {"do_remote_prefill": True, "remote_port": 1, "remote_request_id": "r"}},
     "kv_transfer_params.remote_host"),
    ({"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "h", "remote_port": 70000,
                             "remote_request_id": "r"}}, "kv_transfer_params.remote_port"),
    ({"kv_transfer_params": {"do_remote_decode": True, "remote_block_ids": [1, -2]}},
     "kv_transfer_params.remote_block_ids"),
    ({"kv_transfer_params": {"do_remote_decode": True, "remote_host": "h" * 300}}, "kv_transfer_params.remote_host"),
    ({"kv_transfer_params": SIDECAR_PREFILL, "n": 2}, "kv_transfer_params"),
    ({"kv_transfer_params": SIDECAR_PREFILL, "prompt": ["one", "two"]}, "kv_transfer_params"),
])
def test_bad_params_are_refused_naming_the_key(stack: HttpStack, body: dict[str, Any], param: str) -> None:
    stack.fake.added.clear()
    response = _post(stack, "/v1/completions", {"prompt": "hi", "max_tokens": 1, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text
    assert not stack.fake.added  # refused before anything reached the engine
