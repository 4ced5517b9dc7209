"""Incremental detokenization of generated tokens, one step at a time.

The text of a completion is defined positionally, as vLLM's incremental detokenizer defines it:

    text(output) == decode(prompt + output)[len(decode(prompt)):]

so a completion never repeats prompt text, even when the prompt ends in the middle of a UTF-8 character
(its U+FFFD stands for the prompt's bytes; an output token that completes the character adds no text).

Algorithm (two offsets over a short id window, as in vLLM's `detokenize_incrementally`): the window starts
with a suffix of the prompt; `prefix` is the text of the ids up to `read_offset` (already accounted for),
and each step decodes the window and returns what lies past `len(prefix)`. Invariants:
- `add()` never returns a partial UTF-8 character: while the window's text ends in U+FFFD (or does not
  grow) nothing is returned and the ids stay in the window until a later token completes the text.
- The window starts at a character boundary of the prompt (see `prompt_context`) and is trimmed after
  each emission to the ids of that emission, so the per-step cost is independent of the sequence length
  and the first generated token is decoded in the context of the prompt (leading-space rules of
  byte-level BPE and SentencePiece decoders see the same text as a decode of prompt + output does).
- One tokenizer call per emitting step, whatever its number of ids: the new prefix is the text of the
  ids just emitted, or of the last of them alone when that token's own text is whole (no U+FFFD, not
  empty) — the window feeding one id at a time would leave — read from the shared `TokenTexts` cache
  (token_texts.py: exactly `decode([id])`), so the text is the same as decoding the prefix again.
- Ids fed several at a time give the text they give one at a time (the concatenation; where it is cut
  may differ): a batch whose text ends inside a character is fed again id by id (as vLLM's detokenizer
  always feeds), so only that character is withheld, not the complete text before it in the batch.
- `flush()` returns the text still withheld (a character never finished decodes to U+FFFD, as
  `tokenizer.decode` does), for a caller that wants the definition above exactly; the output processor
  does not call it: like vLLM's, a completion's text leaves out a character it never finished.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tokenizers

from shared_runtime.token_texts import REPLACEMENT, TokenTexts

_MIN_PROMPT_CONTEXT = 4
_MAX_PROMPT_CONTEXT = 24


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas for one completion."""

    __slots__ = ("_decode", "_ids", "_prefix_len", "_read_offset", "_skip_special", "_texts")

    def __init__(
        self, tokenizer_backend: tokenizers.Tokenizer, prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True, texts: TokenTexts | None = None,
    ) -> None:
        """`tokenizer_backend` is a `tokenizers.Tokenizer` (the fast tokenizer behind the wrapper);
        `texts` its shared single-token cache (`Tokenizer.token_texts`; a private one when None)."""
        self._decode: Callable[..., str] = tokenizer_backend.decode
        self._skip_special = skip_special_tokens
        self._texts = texts if texts is not None else TokenTexts(tokenizer_backend)
        self._ids: list[int] = prompt_context(tokenizer_backend, prompt_token_ids)
        self._read_offset = len(self._ids)  # ids before it are accounted for in the returned text
        self._prefix_len = len(self._decode(self._ids, skip_special_tokens=skip_special_tokens))

    def copy(self) -> IncrementalDetokenizer:
        """An independent detokenizer in the same state (the n completions of one prompt share their
        priming: the prompt context is decoded once, not n times)."""
        twin = IncrementalDetokenizer.__new__(IncrementalDetokenizer)
        twin._decode, twin._skip_special, twin._texts = self._decode, self._skip_special, self._texts
        twin._ids, twin._read_offset, twin._prefix_len = list(self._ids), self._read_offset, self._prefix_len
        return twin

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed the newly generated ids; return the text they complete ("" if none yet). One decode for
        any number of ids, unless their text ends inside a character."""
        if not token_ids:
            return ""
        ids = self._ids
        ids.extend(token_ids)
        text = self._decode(ids, skip_special_tokens=self._skip_special)
        if len(text) <= self._prefix_len or text.endswith(REPLACEMENT):
            if len(token_ids) > 1:  # the text before an unfinished character at the end is not withheld
                del ids[len(ids) - len(token_ids):]
                return "".join([self.add((token_id,)) for token_id in token_ids])
            return ""
        delta = text[self._prefix_len :]
        # The ids just read become the new prefix; older ones are no longer needed as context. Of
        # several, the last alone will do when its own text is whole (the window one id at a time
        # feeding leaves), which the shared cache knows without a decode.
        del ids[: self._read_offset]
        if len(ids) > 1:
            last = self._texts.text(ids[-1], self._skip_special)
            if last and REPLACEMENT not in last:
                del ids[:-1]
                self._read_offset, self._prefix_len = 1, len(last)
                return delta
        self._read_offset = len(ids)
        self._prefix_len = self._text_len(ids)
        return delta

    def flush(self) -> str:
        """Text of the withheld ids (with U+FFFD for an unfinished character); "" when none."""
        if len(self._ids) == self._read_offset:
            return ""
        text = self._decode(self._ids, skip_special_tokens=self._skip_special)
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        delta = text[self._prefix_len :]
        self._prefix_len = self._text_len(self._ids)
        return delta

    def _text_len(self, ids: list[int]) -> int:
        """len(decode(ids)): one id from the shared cache, several decoded."""
        if len(ids) == 1:
            return len(self._texts.text(ids[0], self._skip_special))
        return len(self._decode(ids, skip_special_tokens=self._skip_special))


def prompt_context(backend: tokenizers.Tokenizer, prompt_token_ids: Sequence[int]) -> list[int]:
    """A short suffix of the prompt that starts on a character boundary, used to prime the window.

    Takes at least the last few tokens (so leading-space rules see real context) and grows the
    suffix, up to a bound, until its text does not start inside a multi-byte character (a U+FFFD
    first). Where the text may end does not matter: the positional definition accounts for it.
    """
    n = len(prompt_token_ids)
    if n <= _MIN_PROMPT_CONTEXT:
        return list(prompt_token_ids)
    for size in range(_MIN_PROMPT_CONTEXT, min(n, _MAX_PROMPT_CONTEXT) + 1):
        suffix = list(prompt_token_ids[n - size :])
        if not backend.decode(suffix, skip_special_tokens=False).startswith(REPLACEMENT):
            return suffix
    return list(prompt_token_ids[n - min(n, _MAX_PROMPT_CONTEXT) :])
