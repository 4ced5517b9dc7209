"""Incremental detokenization of generated tokens, one step at a time.

Built on `tokenizers.decoders.DecodeStream`, which keeps a short window of ids and emits only the text
that a new id completes. Invariants:
- `add()` never returns a partial UTF-8 character: bytes of an unfinished character are withheld (the
  stream keeps their ids) until a later token completes it.
- The first generated token is decoded in the context of the prompt (the stream is primed with a short
  prompt suffix), so tokenizers that drop or add a leading space at the start of a text (byte-level BPE,
  SentencePiece's metaspace) produce the same text as decoding prompt + output together.
- Per step cost is independent of the sequence length: nothing is re-decoded from the start.
- `flush()` at the end of a completion returns the text of ids still withheld (a character the
  completion never finished decodes to U+FFFD, as `tokenizer.decode` does), so the concatenated deltas
  always equal the decode of all generated ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers.decoders import DecodeStream

_REPLACEMENT_CHAR = "\ufffd"
_MIN_PROMPT_CONTEXT = 4
_MAX_PROMPT_CONTEXT = 24
_EMITTED_TAIL = 4  # ids kept as context for decoding withheld ids at flush


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas for one completion."""

    __slots__ = ("_backend", "_emitted", "_pending", "_skip_special", "_stream")

    def __init__(
        self, tokenizer_backend: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        """`tokenizer_backend` is a `tokenizers.Tokenizer` (the fast tokenizer behind the wrapper)."""
        self._backend = tokenizer_backend
        context = prompt_context(tokenizer_backend, prompt_token_ids)
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._skip_special = skip_special_tokens
        self._emitted: list[int] = context[-_EMITTED_TAIL:]  # last ids whose text was returned
        self._pending: list[int] = []  # ids fed but withheld (they end mid-character)

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed the newly generated ids; return the text they complete ("" if none yet)."""
        if not token_ids:
            return ""
        ids = token_ids if isinstance(token_ids, list) else list(token_ids)
        try:
            text = self._stream.step(self._backend, ids)
        except Exception as exc:  # tokenizers can reject its own window (huggingface/tokenizers#1705)
            if "Invalid prefix" not in str(exc):
                raise
            text = self._restart(ids)
        if text is None:
            self._pending.extend(ids)
            return ""
        if self._pending:
            ids = self._pending + ids
            self._pending = []
        self._emitted = (self._emitted + ids)[-_EMITTED_TAIL:]
        return text

    def _restart(self, ids: list[int]) -> str | None:
        """A fresh stream primed with the last emitted ids, re-fed what the old one was withholding."""
        self._stream = DecodeStream(ids=list(self._emitted), skip_special_tokens=self._skip_special)
        return self._stream.step(self._backend, self._pending + ids)

    def flush(self) -> str:
        """Text of the withheld ids (with U+FFFD for an unfinished character); "" when none."""
        pending, emitted = self._pending, self._emitted
        if not pending:
            return ""
        self._emitted, self._pending = (emitted + pending)[-_EMITTED_TAIL:], []
        decode = self._backend.decode
        base = decode(emitted, skip_special_tokens=self._skip_special)
        full = decode(emitted + pending, skip_special_tokens=self._skip_special)
        if full.startswith(base):
            return full[len(base):]
        return decode(pending, skip_special_tokens=self._skip_special)  # never re-send emitted text


def prompt_context(backend: Any, prompt_token_ids: Sequence[int]) -> list[int]:
    """A short suffix of the prompt that decodes to whole characters, used to prime the stream.

    Takes at least the last few tokens (so leading-space rules see real context) and grows the
    suffix, up to a bound, until it does not start in the middle of a multi-byte character.
    """
    n = len(prompt_token_ids)
    if n <= _MIN_PROMPT_CONTEXT:
        return list(prompt_token_ids)
    for size in range(_MIN_PROMPT_CONTEXT, min(n, _MAX_PROMPT_CONTEXT) + 1):
        suffix = list(prompt_token_ids[n - size :])
        if _REPLACEMENT_CHAR not in backend.decode(suffix, skip_special_tokens=False):
            return suffix
    return list(prompt_token_ids[n - _MIN_PROMPT_CONTEXT :])
