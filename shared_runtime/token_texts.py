"""Token id -> the text of that token decoded alone, decoded once per id and shared per tokenizer.

One `TokenTexts` belongs to each frontend `Tokenizer` (`Tokenizer.token_texts`); the incremental
detokenizer (the length of a one-token prefix), the output processor (a sampled token's text in
logprobs) and the OpenAI layer (top-logprob token texts) all read it, so a token is decoded once per
process, not once per use. Invariants:
- `text(t, skip)` is exactly `backend.decode([t], skip_special_tokens=skip)` (the two flags are cached
  apart: a special token is "" when skipped).
- Memory is bounded: each table is cleared when it reaches `CACHE_LIMIT` entries (a vocabulary larger
  than that keeps working, it only decodes some ids again).
- `pieces()` is exactly the set of ids whose `text(t)` ends in U+FFFD (a byte of a multi-byte
  character, which a logprob row must show in context): every id of the tokenizer's vocabulary decoded
  once, in one batch, the first time it is asked for (the output processor asks when it is made, so no
  request waits for it); ids past the vocabulary decode to "" and are not in it.
"""

from __future__ import annotations

from collections.abc import Callable

import tokenizers

CACHE_LIMIT = 1 << 18
REPLACEMENT = "\ufffd"  # what a decode ends in when it stops inside a multi-byte character


class TokenTexts:
    """Cached single-token decodes of one `tokenizers.Tokenizer`."""

    __slots__ = ("_backend", "_decode", "_kept", "_pieces", "_skipped")

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        self._backend = backend
        self._decode: Callable[..., str] = backend.decode
        self._kept: dict[int, str] = {}  # skip_special_tokens=False
        self._skipped: dict[int, str] = {}  # skip_special_tokens=True
        self._pieces: frozenset[int] | None = None

    @property
    def kept(self) -> dict[int, str]:
        """The skip_special_tokens=False table itself, for a hot loop that reads it before calling
        `text` on a miss (read only: `text` alone fills and bounds it)."""
        return self._kept

    def text(self, token_id: int, skip_special_tokens: bool = False) -> str:
        """`decode([token_id], skip_special_tokens=...)`, from the cache after the first time."""
        table = self._skipped if skip_special_tokens else self._kept
        text = table.get(token_id)
        if text is None:
            if len(table) >= CACHE_LIMIT:
                table.clear()
            text = table[token_id] = self._decode([token_id], skip_special_tokens=skip_special_tokens)
        return text

    def pieces(self) -> frozenset[int]:
        """The ids whose own decode ends in U+FFFD: pieces of a multi-byte character."""
        if self._pieces is None:
            size = self._backend.get_vocab_size(with_added_tokens=True)
            texts = self._backend.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
            self._pieces = frozenset(i for i, text in enumerate(texts) if text.endswith(REPLACEMENT))
        return self._pieces

