"""Shared by the real-model tests: the chat questions and transformers' greedy reference (service processes
are tests/support.py's `Service`)."""

from __future__ import annotations

from typing import Any

import torch

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
