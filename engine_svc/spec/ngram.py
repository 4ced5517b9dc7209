"""Prompt lookup (vLLM's `ngram` method): drafts copied from the request's own earlier tokens.

`propose(tokens, k)`: among the n-grams that end the sequence, for n from `max_n` down to `min_n`, take
the longest that also occurs earlier (its most recent earlier occurrence, as vLLM does) and propose the
up to k tokens that followed it there. No match, no drafts. Runs on the scheduler's host thread with
numpy: the candidate positions are those holding the last token, narrowed one token further back per
n-gram length, so a step costs O(len(tokens)) for the first compare and O(candidates) per length after.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` draft tokens to follow `tokens` (empty when no n-gram matches or k <= 0)."""
        length = len(tokens)
        if k <= 0 or length <= self.min_n:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        # ends[i]: an earlier position whose token equals the last one; matching n-grams end there.
        ends = np.flatnonzero(arr[: length - 1] == arr[-1])
        best = -1
        n = 1
        while len(ends):
            if n >= self.min_n:
                best = int(ends[-1])  # the most recent occurrence of the longest match so far
            if n == self.max_n or n == length - 1:
                break
            ends = ends[ends >= n]  # the n-gram must fit before its end
            ends = ends[arr[ends - n] == arr[length - 1 - n]]
            n += 1
        if best < 0:
            return []
        return tokens[best + 1 : best + 1 + k]
