"""Per-request sampling state and the per-step batch metadata built from it.

`RequestSamplingState` lives as long as its request in the worker. It precomputes everything that does
not change between steps (which features the request uses, the ids min_tokens holds back, a seeded
generator) so that `build_sampling_metadata` is a few attribute reads per row, and a single pass with
no tensor built at all when every row is plain greedy (the common benchmark case).

Invariants:
- `output_token_ids` is append-only: the worker appends each sampled token and never rewrites it.
- A seeded, non-greedy request makes exactly one draw from its generator for each token it samples (a
  `[V]` exponential sample on GPUs, one float64 uniform on CPU: sampler.py), so its random stream is a
  function of (seed, number of tokens sampled) only. A state constructed on resume with
  `output_token_ids=...` replays the draws it owes before its first new one (`RequestSamplingState._draw`),
  so preemption does not change its tokens (given the same logits).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from shared_runtime import limits
from shared_runtime.contract import EngineSamplingParams

# Puts host arrays on the device: the worker's staging (engine_svc/worker/staging.py) or `pinned_copies`.
Stage = Callable[[Sequence[np.ndarray]], list[torch.Tensor]]

# Temperatures below this are greedy (division by such a small number is numerically meaningless).
GREEDY_TEMPERATURE_EPS = limits.GREEDY_TEMPERATURE

_NEVER = math.inf


class ParamColumns(Protocol):
    """Per-row sampling parameters kept by the worker's persistent batch (columns.py `SamplingColumns`)."""

    def params_for(self, rows: np.ndarray) -> StepSamplingParams:
        """The parameters of batch rows `rows` (in step order) on the device."""

# The optional per-row passes of `build_sampling_metadata`, by the name `RequestSamplingState.features` uses.
FEATURES = ("seeded", "allowed", "bad_words", "min_tokens", "bias", "penalties", "logprobs")
# Those whose effect on the next token depends on the tokens the request has output so far.
OUTPUT_FEATURES = frozenset(("bad_words", "min_tokens", "penalties"))


def device_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.tensor(values)` on `device` without making the host wait for the device: on CUDA the
    values go through pinned memory and an asynchronous copy (a plain `torch.tensor(..., device=cuda)`
    copies from pageable memory, which waits for everything queued on the stream)."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor moved to `device` asynchronously (pinned staging on CUDA); as is on CPU."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def pinned_copies(device: torch.device) -> Stage:
    """A `Stage` that pins each array on its own (no persistent buffers): for callers without a worker."""
    return lambda arrays: [to_device(torch.from_numpy(np.ascontiguousarray(a)), device) for a in arrays]


class RequestSamplingState:
    """The sampler's view of one request, kept by the worker for the request's lifetime."""

    def __init__(
        self,
        params: EngineSamplingParams,
        prompt_token_ids: list[int],
        eos_token_ids: list[int],
        vocab_size: int,
        output_token_ids: list[int] | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.params = params
        self.prompt_token_ids = prompt_token_ids
        self.vocab_size = vocab_size
        self.output_token_ids: list[int] = list(output_token_ids) if output_token_ids else []

        self.is_greedy = params.temperature < GREEDY_TEMPERATURE_EPS
        self.has_penalties = (
            params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
            or params.repetition_penalty != 1.0
        )
        self.has_repetition_penalty = params.repetition_penalty != 1.0
        # min_tokens holds back EOS and the stop ids (even with ignore_eos) until it is reached.
        held = set(eos_token_ids) | set(params.stop_token_ids)
        self.min_tokens_held_ids = sorted(t for t in held if 0 <= t < vocab_size)
        self.min_tokens = params.min_tokens if self.min_tokens_held_ids else 0
        # logit_bias as two CPU tensors, built once; None for the (usual) request without one.
        bias = params.logit_bias
        self.bias_ids = torch.tensor(list(bias), dtype=torch.int64) if bias else None
        self.bias_values = torch.tensor(list(bias.values()), dtype=torch.float32) if bias else None
        # allowed_token_ids (a CPU id tensor, built once) and bad words; None / [] for the usual request.
        allowed = params.allowed_token_ids
        self.allowed_ids = torch.tensor(sorted(set(allowed)), dtype=torch.int64) if allowed else None
        self.bad_words = params.bad_words_token_ids
        # The row is "plain" (argmax of the raw logits is the whole job) once it has this many outputs.
        plain_ever = (self.is_greedy and not self.has_penalties and params.logprobs is None and not bias
                      and self.allowed_ids is None and not self.bad_words)
        self.plain_after: float = self.min_tokens if plain_ever else _NEVER

        self.generator: torch.Generator | None = None
        self._stream_draws = 0  # draws the request's random stream has made (notionally, on resume)
        self._generator_draws = 0  # draws made by `self.generator` itself
        if params.seed is not None and not self.is_greedy:
            self.generator = _seeded_generator(params.seed, torch.device(device))
            self._stream_draws = len(self.output_token_ids)

        # The per-row passes of `build_sampling_metadata` this request needs (FEATURES); fixed for its life.
        self.features = frozenset(name for name, used in (
            ("seeded", self.generator is not None), ("allowed", self.allowed_ids is not None),
            ("bad_words", bool(self.bad_words)), ("min_tokens", self.min_tokens > 0),
            ("bias", bool(bias)), ("penalties", self.has_penalties),
            ("logprobs", params.logprobs is not None),
        ) if used)

        # Output ids mirrored into a growing int64 buffer, synced incrementally (penalties only).
        self._out_buf = torch.empty(0, dtype=torch.int64)
        self._out_synced = 0
        self._prompt_ids_tensor: torch.Tensor | None = None

    def draw_exponential(self, size: int, device: torch.device) -> torch.Tensor:
        """The next draw of this request's seeded stream as an Exp(1) sample of `size`, on `device`."""
        return self._draw(lambda g: torch.empty(size, device=device).exponential_(generator=g), device)

    def draw_uniform(self, device: torch.device) -> torch.Tensor:
        """The next draw of this request's seeded stream as one float64 U[0, 1) number (shape [1])."""
        return self._draw(lambda g: torch.rand(1, generator=g, dtype=torch.float64, device=device), device)

    def _draw(self, make: Callable[[torch.Generator], torch.Tensor], device: torch.device) -> torch.Tensor:
        """`make`'s next draw from the seeded generator. The stream's k-th draw is the same whatever
        happened before: a generator that is behind it (fresh after a resume, or re-created because it
        lived on another device) replays first, with the same `make` (a device always draws one kind)."""
        g = self.generator
        assert g is not None and self.params.seed is not None, "only seeded random requests draw"
        if not _same_device(g.device, device):
            g = self.generator = _seeded_generator(self.params.seed, device)
            self._generator_draws = 0
        while self._generator_draws < self._stream_draws:
            make(g)
            self._generator_draws += 1
        self._stream_draws += 1
        self._generator_draws += 1
        return make(g)

    def after_drafts(self, drafts: Sequence[int]) -> RequestSamplingState:
        """This request's state as it would be had `drafts` been accepted: what a verification step
        scores the position after them with, so that the features that read the output (penalties, bad
        words, min_tokens: OUTPUT_FEATURES) see the drafts as output. A read-only copy for one step: it
        has no random stream (the request's own state makes its draws, rejection.py)."""
        view = copy.copy(self)
        view.output_token_ids = [*self.output_token_ids, *drafts]
        view.generator = None
        view._out_buf = torch.empty(0, dtype=torch.int64)
        view._out_synced = 0
        return view

    def output_ids_tensor(self) -> torch.Tensor:
        """`output_token_ids` as a CPU int64 tensor, copying only the ids appended since last call."""
        n = len(self.output_token_ids)
        if n > self._out_synced:
            if n > self._out_buf.numel():
                grown = torch.empty(max(n, 2 * self._out_buf.numel(), 64), dtype=torch.int64)
                grown[: self._out_synced] = self._out_buf[: self._out_synced]
                self._out_buf = grown
            new = self.output_token_ids[self._out_synced : n]
            self._out_buf[self._out_synced : n] = torch.tensor(new, dtype=torch.int64)
            self._out_synced = n
        return self._out_buf[:n]

    def prompt_ids_tensor(self) -> torch.Tensor:
        """The prompt ids as a CPU int64 tensor, built once."""
        if self._prompt_ids_tensor is None:
            self._prompt_ids_tensor = torch.tensor(self.prompt_token_ids, dtype=torch.int64)
        return self._prompt_ids_tensor


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Equal devices, reading a missing accelerator index as 0 ("cuda" == "cuda:0")."""
    return a.type == b.type and (a.index or 0) == (b.index or 0)


def _seeded_generator(seed: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass
class PenaltyMetadata:
    """Penalties for the subset of rows that use any. Token occurrences are given sparsely, as
    (row, token) pairs with `row` indexing into `rows`; the sampler densifies them to [len(rows), V]."""

    rows: torch.Tensor  # [R] int64, batch rows with penalties
    presence: torch.Tensor  # [R] float32
    frequency: torch.Tensor  # [R] float32
    repetition: torch.Tensor | None  # [R] float32, None when no row has a repetition penalty
    output_rows: torch.Tensor  # [T] int64 in [0, R)
    output_tokens: torch.Tensor  # [T] int64, one entry per output token (repeats count)
    prompt_rows: torch.Tensor | None  # [P] int64 in [0, R), rows with a repetition penalty only
    prompt_tokens: torch.Tensor | None  # [P] int64


@dataclass
class StepSamplingParams:
    """The parameters of a step's sampling rows that the sampler reads as tensors: whether every row is
    greedy, and the random rows' temperature and filters (None: no row uses the feature). Built from the
    requests' states (`step_sampling_params`) or gathered from the persistent batch's columns
    (`SamplingColumns.params_for`), which give identical values."""

    all_greedy: bool
    temperature: torch.Tensor | None = None  # [B] float32; greedy rows hold 1.0; None if all greedy
    greedy_rows: torch.Tensor | None = None  # [B] bool; None unless greedy and random rows are mixed
    top_k: torch.Tensor | None = None  # [B] int64; disabled rows hold 0
    top_k_max: int = 0
    top_p: torch.Tensor | None = None  # [B] float32; disabled rows hold 1.0
    min_p: torch.Tensor | None = None  # [B] float32; disabled rows hold 0.0


def effective_top_k(top_k: int, vocab_size: int) -> int:
    """top_k as the sampler applies it: 0 (off) unless it keeps fewer tokens than the vocabulary."""
    return top_k if 0 < top_k < vocab_size else 0


def step_sampling_params(states: list[RequestSamplingState], device: torch.device) -> StepSamplingParams:
    """The rows' parameters straight from their states, one fresh device tensor per field in use."""
    greedy = [s.is_greedy for s in states]
    out = StepSamplingParams(all_greedy=all(greedy))
    if out.all_greedy:
        return out
    params = [s.params for s in states]
    out.temperature = device_tensor([1.0 if g else p.temperature for g, p in zip(greedy, params)], torch.float32,
                                    device)
    if any(greedy):
        out.greedy_rows = device_tensor(greedy, torch.bool, device)
    top_k = [effective_top_k(p.top_k, s.vocab_size) for p, s in zip(params, states)]
    if any(top_k):
        out.top_k = device_tensor(top_k, torch.int64, device)
        out.top_k_max = max(top_k)
    if any(p.top_p < 1.0 for p in params):
        out.top_p = device_tensor([p.top_p for p in params], torch.float32, device)
    if any(p.min_p > 0.0 for p in params):
        out.min_p = device_tensor([p.min_p for p in params], torch.float32, device)
    return out


@dataclass
class SamplingMetadata:
    """Everything the sampler needs for one step, one row per request in batch order.

    Optional fields are None when no row uses the feature, so the sampler skips it entirely.
    """

    all_greedy: bool
    temperature: torch.Tensor | None = None  # [B] float32; greedy rows hold 1.0; None if all greedy
    greedy_rows: torch.Tensor | None = None  # [B] bool; None unless greedy and random rows are mixed
    top_k: torch.Tensor | None = None  # [B] int64; disabled rows hold 0
    top_k_max: int = 0  # max of top_k, known on the host (no device sync to size a topk)
    top_p: torch.Tensor | None = None  # [B] float32; disabled rows hold 1.0
    min_p: torch.Tensor | None = None  # [B] float32; disabled rows hold 0.0
    seeded: list[tuple[int, RequestSamplingState]] | None = None  # (row, state), random rows only
    allowed_token_ids: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows, entry rows, ids)
    bad_words_mask: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) to set -inf
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) to set -inf
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows, token ids, biases) to add
    penalties: PenaltyMetadata | None = None
    num_logprobs: list[int | None] | None = None  # per row: top-N asked for, None = not asked

    @property
    def is_plain_greedy(self) -> bool:
        """True when argmax over the raw logits is the whole job."""
        return (
            self.all_greedy
            and self.min_tokens_mask is None
            and self.allowed_token_ids is None
            and self.bad_words_mask is None
            and self.logit_bias is None
            and self.penalties is None
            and self.num_logprobs is None
        )


PLAIN_GREEDY = SamplingMetadata(all_greedy=True)


def build_sampling_metadata(
    states: list[RequestSamplingState], device: torch.device, *, columns: ParamColumns | None = None,
    rows: np.ndarray | None = None, stage: Stage | None = None, present: Container[str] | None = None,
) -> SamplingMetadata:
    """Gather the batch's sampling knobs into tensors on `device` (row i = states[i]).

    Pass only the rows that sample this step (a seeded row advances its stream when sampled). With
    `columns` (the worker's persistent per-row parameters) and `rows` (states[i] lives in batch row
    rows[i]), temperature and filters come from the columns, copied only when the rows changed; per-step
    arrays (min_tokens masks, penalty tokens) go up through `stage` (default: one pinned copy each).
    The returned object is read-only: the all-plain-greedy case returns one shared instance.
    `present`, when given, must hold every name in FEATURES that any of `states` has in its `features`
    (the worker passes those of all its live requests): a pass over the rows for a feature not in it is
    skipped, since it would find nothing.

    Cost when every row is plain greedy: one comparison per row, no tensors.
    """
    if all(len(s.output_token_ids) >= s.plain_after for s in states):
        return PLAIN_GREEDY

    if columns is not None and rows is not None:
        params = columns.params_for(rows)
    else:
        params = step_sampling_params(states, device)
    meta = SamplingMetadata(
        all_greedy=params.all_greedy, temperature=params.temperature, greedy_rows=params.greedy_rows,
        top_k=params.top_k, top_k_max=params.top_k_max, top_p=params.top_p, min_p=params.min_p,
    )
    if present is None:
        present = FEATURES
    if not params.all_greedy and "seeded" in present:
        meta.seeded = [(i, s) for i, s in enumerate(states) if s.generator is not None] or None
    stage = stage or pinned_copies(device)
    if "allowed" in present:
        meta.allowed_token_ids = _allowed_token_ids(states, stage)
    if "bad_words" in present:
        meta.bad_words_mask = _bad_words_mask(states, stage)
    if "min_tokens" in present:
        meta.min_tokens_mask = _min_tokens_mask(states, stage)
    if "bias" in present:
        meta.logit_bias = _logit_bias(states, stage)
    if "penalties" in present:
        meta.penalties = _penalty_metadata(states, stage)
    if "logprobs" in present and any(s.params.logprobs is not None for s in states):
        meta.num_logprobs = [s.params.logprobs for s in states]
    return meta


def _min_tokens_mask(states: list[RequestSamplingState], stage: Stage) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    cols: list[int] = []
    for i, s in enumerate(states):
        if len(s.output_token_ids) < s.min_tokens:
            rows.extend([i] * len(s.min_tokens_held_ids))
            cols.extend(s.min_tokens_held_ids)
    return _stage_pairs(rows, cols, stage)


def _stage_pairs(rows: list[int], cols: list[int], stage: Stage) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row, token id) pairs staged as two int64 tensors; None when there are none."""
    if not rows:
        return None
    row_ids, col_ids = stage([np.array(rows, dtype=np.int64), np.array(cols, dtype=np.int64)])
    return row_ids, col_ids


def _allowed_token_ids(
    states: list[RequestSamplingState], stage: Stage
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(restricted batch rows [R], each allowed entry's index into them, the entries' token ids); None when
    no row restricts its tokens."""
    rows = [i for i, s in enumerate(states) if s.allowed_ids is not None]
    if not rows:
        return None
    ids = [t for t in (states[i].allowed_ids for i in rows) if t is not None]
    counts = np.array([t.numel() for t in ids], dtype=np.int64)
    entry_rows = np.repeat(np.arange(len(rows), dtype=np.int64), counts)
    staged_rows, staged_entries, staged_ids = stage([np.array(rows, dtype=np.int64), entry_rows,
                                                     torch.cat(ids).numpy()])
    return staged_rows, staged_entries, staged_ids


def _bad_words_mask(states: list[RequestSamplingState], stage: Stage) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row, token id) pairs to ban this step: a bad word's last id wherever the row's output ends with
    the ids before it (vLLM's apply_bad_words, on the output tokens only)."""
    rows: list[int] = []
    cols: list[int] = []
    for i, s in enumerate(states):
        if not s.bad_words:
            continue
        out = s.output_token_ids
        for word in s.bad_words:
            prefix = len(word) - 1
            if prefix <= len(out) and (prefix == 0 or out[-prefix:] == word[:-1]):
                rows.append(i)
                cols.append(word[-1])
    return _stage_pairs(rows, cols, stage)


def _logit_bias(
    states: list[RequestSamplingState], stage: Stage
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The biased rows' (row, token id, bias) triples, one per entry; None when no row has a bias."""
    rows: list[int] = []
    ids: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for i, s in enumerate(states):
        if s.bias_ids is not None and s.bias_values is not None:
            rows.append(i)
            ids.append(s.bias_ids)
            values.append(s.bias_values)
    if not rows:
        return None
    counts = np.array([t.numel() for t in ids], dtype=np.int64)
    row_index = np.repeat(np.array(rows, dtype=np.int64), counts)
    staged_rows, staged_ids, staged_values = stage([row_index, torch.cat(ids).numpy(), torch.cat(values).numpy()])
    return staged_rows, staged_ids, staged_values


def _penalty_metadata(states: list[RequestSamplingState], stage: Stage) -> PenaltyMetadata | None:
    rows = [i for i, s in enumerate(states) if s.has_penalties]
    if not rows:
        return None
    pen = [states[i] for i in rows]
    out_ids = [s.output_ids_tensor() for s in pen]
    out_lens = np.array([t.numel() for t in out_ids], dtype=np.int64)
    arrays = [
        np.array(rows, dtype=np.int64),
        np.array([s.params.presence_penalty for s in pen], dtype=np.float32),
        np.array([s.params.frequency_penalty for s in pen], dtype=np.float32),
        np.repeat(np.arange(len(pen), dtype=np.int64), out_lens),
        torch.cat(out_ids).numpy(),
    ]
    rep = [j for j, s in enumerate(pen) if s.has_repetition_penalty]
    if rep:
        prompt_ids = [pen[j].prompt_ids_tensor() for j in rep]
        prompt_lens = np.array([t.numel() for t in prompt_ids], dtype=np.int64)
        arrays += [
            np.array([s.params.repetition_penalty for s in pen], dtype=np.float32),
            np.repeat(np.array(rep, dtype=np.int64), prompt_lens),
            torch.cat(prompt_ids).numpy(),
        ]
    staged = stage(arrays)
    meta = PenaltyMetadata(
        rows=staged[0], presence=staged[1], frequency=staged[2], repetition=None,
        output_rows=staged[3], output_tokens=staged[4], prompt_rows=None, prompt_tokens=None,
    )
    if rep:
        meta.repetition, meta.prompt_rows, meta.prompt_tokens = staged[5:8]
    return meta
