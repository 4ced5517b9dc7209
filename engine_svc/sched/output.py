"""What the scheduler tells the workers each step.

A request is sent in full once (`NewRequestData`) when it is first scheduled, and again in full when it
resumes after a preemption (the worker dropped it). Every later step carries only a diff
(`CachedRequestData`): the tokens appended since its last schedule and the blocks added to its table.
Workers keep a persistent batch and rebuild their inputs from these diffs alone; ids listed in
`finished_req_ids` / `preempted_req_ids` must be dropped from that batch before the step runs.

The commonest diff, a steady decode (exactly one appended token, no new block), travels columnar instead
(`decode_req_ids` / `decode_token_ids` / `decode_num_computed_tokens`, one entry per such request): no
struct and no lists per request per step. A scheduled request that is neither new nor such a decode has
a `CachedRequestData`; `SchedulerOutput.cached_diffs()` gives every diff in the per-request form.

Async scheduling (`--async-scheduling`): the scheduler plans a step before it has seen the tokens that
the step before it samples. A diff then appends `PLACEHOLDER_TOKEN` for each such token (only ever the
last token of a decode): the worker feeds the id it sampled itself in its previous step, on the device
(engine_svc/worker/sampled_feed.py), and learns its value on the host while the step runs.
With speculative decoding as well, a request whose previous step verified drafts gets one placeholder
for that step's whole run (its accepted drafts and the token after them), its `num_computed_tokens`
counts that step's draft places as if all were accepted (the worker, which knows the run, subtracts the
rejected ones: engine_svc/worker/spec_async.py), and its `scheduled_spec_decode_tokens` are
`PENDING_DRAFT` places that the worker fills with drafts it proposes itself.

These are msgspec structs so the multiproc executor can broadcast them without pickle.
"""

from __future__ import annotations

from typing import Any

import msgspec

from shared_runtime.contract import EngineSamplingParams

PLACEHOLDER_TOKEN = -1  # a token the worker sampled in its previous step, not yet seen by the scheduler


class NewRequestData(msgspec.Struct, kw_only=True, array_like=True, gc=False):
    req_id: str
    token_ids: list[int]  # every known token: prompt + outputs so far (non-empty outputs after resume)
    num_prompt_tokens: int
    sampling_params: EngineSamplingParams
    block_ids: list[int]  # the whole block table
    num_computed_tokens: int  # tokens already in the cache (prefix hits) before this step
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    lora_id: int = 0  # the LoRA adapter to run it under (engine_svc/lora/modules.py ids); 0 = the base model


class CachedRequestData(msgspec.Struct, kw_only=True, array_like=True, gc=False):
    req_id: str
    new_token_ids: list[int]  # tokens appended to the request since it was last scheduled
    new_block_ids: list[int]  # blocks appended to its block table
    num_computed_tokens: int  # tokens in the cache before this step


class GrammarBitmask(msgspec.Struct, kw_only=True, array_like=True, gc=False):
    """Structured outputs this step (engine_svc/structured/bitmask.py): the rows of each constrained
    request that samples (one, or 1 + k when it verifies k drafts), `words` = int32 rows of
    ceil(vocab_size / 32) words, bit t set = token t allowed."""

    req_ids: list[str]
    words: bytes
    rows: list[int] = []  # rows of each request (1 + its drafts verified this step); [] = one row each


class KVBlockLoad(msgspec.Struct, array_like=True, gc=False):
    """Pulled K/V (P/D disaggregation, engine_svc/kv_transfer/) that a step writes into the cache before
    its forward pass: `data` holds `len(block_ids)` blocks in engine_svc/kv_transfer/blocks.py's format.
    In one process it is a memoryview of the pull's buffer (no copy); it travels to worker processes as
    msgpack bin and is decoded as `bytes` they own (executor/codec.py). Typed `Any` because msgspec takes
    no union of bytes-like types."""

    block_ids: list[int]
    data: Any  # bytes | memoryview


class LoRALoad(msgspec.Struct, array_like=True, gc=False):
    """An adapter loaded at run time (engine_svc/lora/registry.py): every worker starts reading it under
    `lora_id` in the background when the step that carries it begins (the engine validated `path`
    already); the step outputs say when every rank holds it (ModelRunnerOutput.lora_ready)."""

    lora_id: int
    name: str
    path: str


class SchedulerOutput(msgspec.Struct, kw_only=True, array_like=True, gc=False):
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    # Tokens to run for each scheduled request this step (new and cached alike), in schedule order.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests that ended (finished or aborted) or were preempted since the previous step.
    finished_req_ids: list[str] = msgspec.field(default_factory=list)
    preempted_req_ids: list[str] = msgspec.field(default_factory=list)
    # The allowed tokens of this step's constrained rows; None when no scheduled request has a grammar.
    grammar: GrammarBitmask | None = None
    # For the scheduler's own step stats (workers ignore it): prompt tokens among the scheduled tokens of
    # each request that has any (prefill chunks); decodes are absent.
    num_prompt_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    # Steady decodes, columnar: request decode_req_ids[i] appends the one token decode_token_ids[i], gets
    # no block, and had decode_num_computed_tokens[i] tokens in the cache before this step.
    decode_req_ids: list[str] = msgspec.field(default_factory=list)
    decode_token_ids: list[int] = msgspec.field(default_factory=list)
    decode_num_computed_tokens: list[int] = msgspec.field(default_factory=list)
    # The scheduler's count of schedule() calls when it made this output (its own bookkeeping; workers ignore it).
    step_id: int = 0
    # Speculative decoding: the drafts each verifying request runs after its last known token this step
    # (vLLM's name). Its num_scheduled_tokens count them: 1 + len(drafts) for a decode. The drafts are not
    # tokens of the request: the worker writes them past its known tokens for this step only.
    scheduled_spec_decode_tokens: dict[str, list[int]] = msgspec.field(default_factory=dict)
    # Pulled blocks of the requests this step admits (written before the step runs); usually empty.
    kv_loads: list[KVBlockLoad] = msgspec.field(default_factory=list)
    # LoRA adapters loaded / dropped at run time, taken by every worker before the step runs (drops
    # first; a load is read in the background); usually empty. A drop names an id no request uses any more.
    lora_loads: list[LoRALoad] = msgspec.field(default_factory=list)
    lora_drops: list[int] = msgspec.field(default_factory=list)

    def cached_diffs(self) -> list[CachedRequestData]:
        """Every cached request's diff as a `CachedRequestData` (the columnar decodes expanded), in
        schedule order. For tests and tools: the worker reads the columns directly."""
        decodes = [
            CachedRequestData(req_id=r, new_token_ids=[t], new_block_ids=[], num_computed_tokens=c)
            for r, t, c in zip(self.decode_req_ids, self.decode_token_ids, self.decode_num_computed_tokens)
        ]
        order = {r: i for i, r in enumerate(self.num_scheduled_tokens)}
        return sorted([*self.scheduled_cached_reqs, *decodes], key=lambda d: order.get(d.req_id, len(order)))

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class ModelRunnerOutput(msgspec.Struct, kw_only=True, array_like=True, gc=False):
    """What rank 0's worker returns for one step.

    `sampled_token_ids[i]` belongs to `req_ids[i]`; it is -1 for a request whose scheduled tokens did
    not reach the end of its known tokens (a partial prefill chunk), which samples nothing.
    """

    req_ids: list[str]
    sampled_token_ids: list[int]
    # Per request in req_ids: (logprob, rank, top ids, top logprobs) of its sampled token, when asked.
    logprobs: list[tuple[float, int, list[int], list[float]] | None] | None = None
    # Prompt logprobs computed this step, per request: rows for the positions of this chunk.
    prompt_logprobs: dict[str, list[tuple[int, float, int, list[int], list[float]]]] = msgspec.field(
        default_factory=dict
    )
    # Verified requests (those with drafts this step): every token the verification yields, its accepted
    # drafts then the one the target sampled (sampled_token_ids holds the first); and, when asked, the
    # logprobs of each of those tokens.
    spec_token_ids: dict[str, list[int]] = msgspec.field(default_factory=dict)
    spec_logprobs: dict[str, list[tuple[float, int, list[int], list[float]]]] = msgspec.field(default_factory=dict)
    # Verified requests whose workers proposed fewer drafts than the step's places (async scheduling with
    # prompt lookup): the drafts proposed, for the acceptance counters. Absent: as many as places.
    spec_num_drafts: dict[str, int] = msgspec.field(default_factory=dict)
    # LoRA adapters loaded at run time whose read every rank finished by this step (engine_svc/lora/
    # runtime_loads.py): ids now held by every worker, and ids whose read failed (the error); usually empty.
    lora_ready: list[int] = msgspec.field(default_factory=list)
    lora_failed: dict[int, str] = msgspec.field(default_factory=dict)
