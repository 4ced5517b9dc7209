"""The worker's persistent batch: per-request token ids and block tables kept across steps.

Each live request owns one row of preallocated numpy arrays. The scheduler sends a request in full once
(`add`), then only diffs (`apply_diff`: appended tokens and blocks); `remove` frees the row. `prepare`
turns one step's schedule into flat model inputs with vectorised numpy (no per-token Python work).

Invariant: for a live request, `token_ids[row, :num_tokens[row]]` are all its known tokens and
`block_table[row, :num_blocks[row]]` its block ids; `num_computed[row]` tokens already have K/V cached.
With hybrid KV groups (`num_groups` G > 1, engine_svc/kv/groups.py) a row holds the groups' tables
interleaved (entry i * G + g: group g's block i), and `prepare` gives one slot mapping per group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class StepInputs:
    """Flat inputs for one step, requests in `req_ids` order (decodes, q_len == 1, first)."""

    req_ids: list[str]
    query_lens: np.ndarray  # [B]
    query_start_loc: np.ndarray  # [B + 1]
    seq_lens: np.ndarray  # [B]: context length after this step
    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T], or [G, T] with hybrid KV groups (row g: group g's slots)
    block_table: np.ndarray  # [B, max_blocks_in_batch]
    num_decodes: int
    # Requests whose scheduled tokens reach the end of their known tokens: they sample this step.
    sample_mask: np.ndarray  # [B] bool
    rows: np.ndarray  # [B] int64: each request's row of the persistent batch


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int, num_groups: int = 1) -> None:
        self.block_size = block_size
        self.num_groups = num_groups
        max_blocks = -(-max_model_len // block_size) * num_groups
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        # The last `apply_decode_diffs`' ids and their rows, for `prepare` to reuse when the step lays out
        # exactly those requests in that order (a steady decode step); cleared by `add` and `remove`.
        self._decode_rows: tuple[list[str], np.ndarray] | None = None

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.row_of

    def add(self, req_id: str, token_ids: list[int], block_ids: list[int], num_computed: int) -> int:
        row = self._free_rows.pop()
        self.row_of[req_id] = row
        self._decode_rows = None
        n, nb = len(token_ids), len(block_ids)
        self.token_ids[row, :n] = token_ids
        self.num_tokens[row] = n
        self.block_table[row, :nb] = block_ids
        self.num_blocks[row] = nb
        self.num_computed[row] = num_computed
        return row

    def apply_decode_diffs(self, req_ids: Sequence[str], new_tokens: Sequence[int],
                           num_computed: Sequence[int]) -> None:
        """`apply_diff` for many requests at once, each appending exactly one token and no block (the
        common decode step): three vectorised numpy writes instead of a loop over requests."""
        if not req_ids:
            return
        rows = self._rows(req_ids)
        self._decode_rows = (list(req_ids), rows)
        ends = self.num_tokens[rows]
        self.token_ids[rows, ends] = new_tokens
        self.num_tokens[rows] = ends + 1
        self.num_computed[rows] = num_computed

    def _rows(self, req_ids: list[str] | Sequence[str]) -> np.ndarray:
        """The rows of `req_ids`, in order: those of the last `apply_decode_diffs` when `req_ids` are its
        ids in its order (no row can have moved since: `add` and `remove` drop that memo)."""
        memo = self._decode_rows
        if memo is not None and memo[0] == req_ids:
            return memo[1]
        row_of = self.row_of
        return np.fromiter((row_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids))

    def apply_diff(self, req_id: str, new_token_ids: list[int], new_block_ids: list[int],
                   num_computed: int) -> None:
        row = self.row_of[req_id]
        if new_token_ids:
            n = int(self.num_tokens[row])
            self.token_ids[row, n : n + len(new_token_ids)] = new_token_ids
            self.num_tokens[row] = n + len(new_token_ids)
        if new_block_ids:
            nb = int(self.num_blocks[row])
            self.block_table[row, nb : nb + len(new_block_ids)] = new_block_ids
            self.num_blocks[row] = nb + len(new_block_ids)
        self.num_computed[row] = num_computed

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self._free_rows.append(row)
            self._decode_rows = None

    def prepare(self, num_scheduled: dict[str, int]) -> StepInputs:
        """Lay out one step. Decodes first so attention can batch them; the rest keep schedule order."""
        num_reqs = len(num_scheduled)
        counts = num_scheduled.values()
        if num_reqs and min(counts) == 1 == max(counts):  # every request decodes one token (the steady step)
            req_ids = list(num_scheduled)
            num_decodes = num_reqs
            query_lens = np.ones(num_reqs, dtype=np.int64)
        else:
            decode_ids = [r for r, n in num_scheduled.items() if n == 1]
            req_ids = decode_ids + [r for r, n in num_scheduled.items() if n != 1]
            num_decodes = len(decode_ids)
            query_lens = np.fromiter((num_scheduled[r] for r in req_ids), dtype=np.int64, count=num_reqs)
        rows = self._rows(req_ids)
        query_start_loc = np.zeros(len(req_ids) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        total = int(query_start_loc[-1])

        start = self.num_computed[rows]
        seq_lens = start + query_lens
        token_rows = np.repeat(rows, query_lens)
        positions = np.arange(total, dtype=np.int64) - np.repeat(query_start_loc[:-1] - start, query_lens)
        bs, groups = self.block_size, self.num_groups
        if groups == 1:
            slot_mapping = self.block_table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        else:
            columns = (positions // bs * groups)[None, :] + np.arange(groups)[:, None]
            slot_mapping = self.block_table[token_rows[None, :], columns].astype(np.int64) * bs + positions % bs
        max_blocks = int(-(-seq_lens.max() // bs)) * groups if len(req_ids) else 0
        return StepInputs(
            req_ids=req_ids,
            query_lens=query_lens,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            input_ids=self.token_ids[token_rows, positions],
            positions=positions,
            slot_mapping=slot_mapping,
            block_table=self.block_table[rows, :max_blocks],
            num_decodes=num_decodes,
            sample_mask=seq_lens >= self.num_tokens[rows],
            rows=rows,
        )
