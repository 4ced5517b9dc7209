"""Shared by the real-model tests: the chat questions, transformers' greedy reference, and `Fleet` (the engine
and frontend processes a module's fixture starts, as tests/support.py `Service`s)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from tests.support import Service, free_port

START_TIMEOUT_S = 180.0  # loading SmolLM2 from its GGUF file

# Short chat questions with coherent greedy answers (SmolLM2 is a 135M model).
CHAT_QUESTIONS = (
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Write a haiku about the sea.",
    "¿Cuál es la capital de España?",
)
# A question whose answer holds CJK characters split across byte-level tokens.
MULTIBYTE_QUESTION = "Write the Chinese characters for 'China'."
MAX_TOKENS = 24


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def greedy(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy continuation of `prompt` (EOS included when it stops there)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_tokens, pad_token_id=model.config.eos_token_id)
    return [int(t) for t in out[0, len(prompt):]]


@dataclass(frozen=True)
class SharedPair:
    """The session's SmolLM2 engine and the base URL of the HTTP frontend in front of it."""

    engine: Service
    url: str


class Fleet:
    """The processes one fixture starts. Leaving the `with` block stops every one of them, the last started
    first, however the block ends (a failed start or wait included)."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.services: list[Service] = []

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        for service in reversed(self.services):
            service.stop()

    def start(self, service: Service) -> Service:
        self.services.append(service)
        return service.start()

    def engine(self, model: Path, *flags: str) -> Service:
        """`engine_svc.cli --model MODEL` in float32 on a free loopback port with metrics off;
        `flags` come last, so they override those defaults."""
        port = free_port()
        return self.start(Service("engine", [sys.executable, "-m", "engine_svc.cli", "--model", str(model),
                                             "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                                             "--metrics-port", "0", *flags], port, self.logs))

    def frontend(self, engine: Service, *flags: str, name: str = "frontend") -> Service:
        """`frontend_svc.cli --engine ENGINE` on a free loopback port with metrics off (no --model unless
        `flags` name one)."""
        port = free_port()
        return self.start(Service(name, [sys.executable, "-m", "frontend_svc.cli", "--engine", engine.address,
                                         "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0",
                                         *flags], port, self.logs))

    def wait_serving(self) -> None:
        """Every service started so far serves gRPC health, in start order (SmolLM2 loads in START_TIMEOUT_S)."""
        for service in self.services:
            service.wait_serving(START_TIMEOUT_S)
