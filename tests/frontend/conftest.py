"""Fixtures for the frontend processing tests: the tiny model's tokenizer, built once per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def backend(tokenizer):
    """The `tokenizers.Tokenizer` behind the wrapper (what the detokenizer streams with)."""
    return tokenizer.backend


@pytest.fixture(scope="session")
def encode(tokenizer):
    """Text -> ids without special tokens (the way generated text would be tokenized)."""
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="session")
def encode_prompt(tokenizer):
    """Text -> ids as a prompt (BOS first)."""
    return lambda text: tokenizer.encode(text)
