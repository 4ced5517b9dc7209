"""vLLM's utility routes on the OpenAI HTTP API (fake engine, real sockets): /tokenize in both forms and
/detokenize against transformers' tokenizer directly, their 400s naming the field, /version, /ping and
GET /v1/models/{model}."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from transformers import AutoTokenizer

from shared_runtime import limits
from tests.openai_api.conftest import HttpStack
from tests.support import LoopThread

CONTEXT = 256
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo, wörld!"}]


@pytest.fixture(scope="module")
def stack(loop: LoopThread, tokenizer: Any, tiny_model_dir: Path) -> Iterator[HttpStack]:
    stack = HttpStack(loop, tokenizer, tiny_model_dir, max_model_len=CONTEXT)
    stack.wait_http_ready()
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def post(stack: HttpStack, path: str, body: dict[str, Any]) -> httpx2.Response:
    return httpx2.post(f"{stack.url}{path}", json=body, timeout=30)


def error_of(response: httpx2.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    return error


def test_tokenize_a_prompt_as_transformers_does(stack: HttpStack, hf: Any) -> None:
    text = "The sea, the sea! Ünïcode too."
    out = post(stack, "/tokenize", {"model": stack.frontend.config.model_name, "prompt": text}).json()
    expected = hf(text)["input_ids"]
    assert expected[0] == hf.bos_token_id
    assert out == {"count": len(expected), "max_model_len": CONTEXT, "tokens": expected, "token_strs": None}
    bare = post(stack, "/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True}).json()
    ids = hf(text, add_special_tokens=False)["input_ids"]
    assert bare["tokens"] == ids and bare["token_strs"] == hf.convert_ids_to_tokens(ids)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tokenize_a_chat_as_the_template_renders_it(stack: HttpStack, hf: Any, add_generation_prompt: bool) -> None:
    out = post(stack, "/tokenize", {"messages": CHAT, "add_generation_prompt": add_generation_prompt}).json()
    expected = hf.apply_chat_template(CHAT, add_generation_prompt=add_generation_prompt, tokenize=True,
                                      return_dict=False)
    assert out["tokens"] == list(expected) and out["count"] == len(expected)
    cont = post(stack, "/tokenize", {"messages": [*CHAT, {"role": "assistant", "content": "Hi"}],
                                     "add_generation_prompt": False, "continue_final_message": True}).json()
    assert hf.decode(cont["tokens"]).endswith("Hi")


def test_detokenize_round_trips_and_keeps_special_tokens(stack: HttpStack, hf: Any) -> None:
    ids = post(stack, "/tokenize", {"messages": CHAT}).json()["tokens"]
    out = post(stack, "/detokenize", {"model": stack.frontend.config.model_name, "tokens": ids})
    assert out.status_code == 200 and out.json() == {"prompt": hf.decode(ids)}
    assert hf.bos_token in out.json()["prompt"]  # vLLM decodes with the tokenizer's defaults


def test_bad_tokenize_and_detokenize_requests_are_400_naming_the_field(stack: HttpStack) -> None:
    vocab = stack.frontend.tokenizer.vocab_size
    assert "vocab_size" in error_of(post(stack, "/detokenize", {"tokens": [1, vocab]}), 400)["message"]
    assert error_of(post(stack, "/detokenize", {"tokens": [1, vocab]}), 400)["param"] == "tokens"
    too_many = error_of(post(stack, "/detokenize", {"tokens": [5] * (CONTEXT + 1)}), 400)
    assert too_many["param"] == "tokens" and "max_model_len" in too_many["message"]
    assert error_of(post(stack, "/detokenize", {"tokens": [-1]}), 400)["param"] == "tokens.[0]"
    huge = "x" * (limits.max_prompt_bytes(CONTEXT) + 1)
    assert error_of(post(stack, "/tokenize", {"prompt": huge}), 400)["param"] == "prompt"
    both = {"messages": CHAT, "add_generation_prompt": True, "continue_final_message": True}
    assert error_of(post(stack, "/tokenize", both), 400)["param"] == "continue_final_message"
    untrusted = error_of(post(stack, "/tokenize", {"messages": CHAT, "chat_template": "{{ 1 }}"}), 400)
    assert untrusted["param"] == "chat_template"  # only with --trust-request-chat-template, as chat
    long_chat = {"messages": [{"role": "user", "content": "x"}] * (CONTEXT + 1)}
    assert error_of(post(stack, "/tokenize", long_chat), 400)["param"] == "messages"
    refused = error_of(post(stack, "/tokenize", {"messages": CHAT, "mm_processor_kwargs": {"a": 1}}), 400)
    assert refused["param"] == "mm_processor_kwargs"
    assert error_of(post(stack, "/tokenize", {"prompt": 5}), 400)["param"] == "prompt"
    assert error_of(httpx2.post(f"{stack.url}/tokenize", content=b"[1]"), 400)["message"]
    unknown = error_of(post(stack, "/tokenize", {"model": "nope", "prompt": "hi"}), 404)
    assert unknown["code"] == "model_not_found" and unknown["param"] == "model"
    assert error_of(post(stack, "/detokenize", {"model": "nope", "tokens": [5]}), 404)["code"] == "model_not_found"
    stack.wait_engine_idle()  # every admission slot the pool work held is back


def test_version_ping_and_the_model_card(stack: HttpStack) -> None:
    version = httpx2.get(f"{stack.url}/version").json()
    assert version == {"version": importlib.metadata.version("tandem")}
    assert httpx2.get(f"{stack.url}/ping").status_code == 200
    assert httpx2.post(f"{stack.url}/ping").status_code == 200
    name = stack.frontend.config.model_name
    card = httpx2.get(f"{stack.url}/v1/models/{name}").json()
    assert card == httpx2.get(f"{stack.url}/v1/models").json()["data"][0]
    assert card["id"] == name and card["object"] == "model" and card["max_model_len"] == CONTEXT
    missing = error_of(httpx2.get(f"{stack.url}/v1/models/org/other-model"), 404)
    assert missing["code"] == "model_not_found" and "org/other-model" in missing["message"]
