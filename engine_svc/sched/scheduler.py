"""The V1 scheduler: one token budget, no prefill/decode phases.

Each step (`schedule`):
1. Running requests, in order, get `min(num_tokens - num_computed_tokens, budget left)` tokens. When the
   KV cache cannot hold them, the scheduler preempts (recompute) a victim - the tail of `running`, or under
   `priority` the running request with the worst (priority, arrival_time) - and retries; if the victim is the
   request being scheduled, the running pass stops.
2. Only if nothing was preempted, waiting requests are admitted in policy order while the budget,
   `max_num_seqs` and the free blocks allow, each after a prefix-cache lookup; a long prompt gets a chunk.
   Long prefills: while some running request is decoding, no request gets more than
   `long_prefill_token_threshold` tokens in a step (vLLM's option; 0 = off), so the step that carries
   the decodes - and the gap between their tokens - stays short. A prefill with nobody decoding beside
   it has no stream to stall and takes what the budget allows.
3. The output sends a request in full on its first schedule and on resume after a preemption, otherwise
   only what the workers have not seen (appended tokens and blocks); a steady decode (one token, no
   block) goes in the output's decode columns, not as a per-request struct.
4. `num_computed_tokens` advances by the scheduled count right away: the K/V of the scheduled tokens is
   considered written once the step runs.

`update_from_output` appends sampled tokens, applies the stop conditions, frees finished requests and
builds the step's `EngineCoreOutputs`.

Steps in flight (the engine core's batch queue, engine_svc/core.py): `schedule` may run again before the
previous output reached `update_from_output`. Each request counts the tokens it samples in such steps
(`num_output_placeholders`). Without async scheduling a request with a sample in flight has nothing to
compute (its known tokens are all scheduled), so another step only takes other requests. With
`async_scheduling` it is scheduled up to `num_tokens + num_output_placeholders`: the diff appends
`PLACEHOLDER_TOKEN` for the token it has not seen (engine_svc/sched/output.py), which the worker fills
from its own previous step. Such a request is left out of a step when the token in flight must end it
(it reaches `max_total_tokens`) and, with a grammar, until that token is known (its bitmask needs the
grammar advanced by it: constrained requests do not overlap; see docs/architecture.md). A request that
ends by a token in flight (EOS, a stop id, an abort, a stop string) has had at most one more step
scheduled; that step's output for it is dropped. A request preempted while its sample is in flight still
gets that token (as vLLM does), and is not admitted again while a step in flight holds it. Outputs of a
step for an ended request whose id was reused since (`_stale`) are dropped.
Speculative decoding under async scheduling: a request that decodes next gets k `PENDING_DRAFT` places
(`_draft_places`, for every method: the workers propose the drafts) over its horizon; a verifying step
counts 1 + k placeholders, as if all its places were accepted (`num_spec_in_flight`: the k), so the next
step is laid out past them; its diff sends one placeholder for the whole run. `_on_verified` gives back
the rejected places (placeholders and `num_computed_tokens`), which makes the step in flight's count
exact; the worker corrects that step's positions itself (engine_svc/worker/spec_async.py). A request
whose places in flight could reach `max_total_tokens` is left out until its run is known (the rule above).

Structured outputs (engine_svc/structured/): a request with a constraint waits in WAITING_FOR_FSM (in
`_compiling`, not in `waiting`) until its grammar compiles off this thread; each `schedule` first moves
the compiled ones into `waiting` with their matcher (or ends them with INVALID_ARGUMENT), then fills the
bitmask rows of the constrained requests that sample this step. `_on_sampled` advances the matcher.

P/D disaggregation (engine_svc/kv_transfer/connector.py, with a `kv_connector`): a consumer's request
that names a producer pulls its prompt's K/V in WAITING_FOR_REMOTE_KVS (in `_loading`, holding no block)
and joins `waiting` when the pull ends; its admission counts the pulled tokens as computed beyond the
prefix-cache hit and the step carries their bytes (`SchedulerOutput.kv_loads`). A producer's request that
finishes by length keeps its blocks under a lease; each `schedule` first frees the leases that ended.

Invariants:
- Every request given to `add_request` appears exactly once in an output with a finish reason (stopped,
  length, aborted, or rejected with an error); its blocks are back in the pool by then.
- `running` holds only RUNNING requests and `len(running) <= max_num_seqs`; `waiting` holds WAITING and
  PREEMPTED ones; `_compiling` WAITING_FOR_FSM ones, `_loading` WAITING_FOR_REMOTE_KVS ones. Requests in
  none of them are unknown to the scheduler.
- A live request never has more than `min(max_model_len, num_blocks // num_groups * block_size)` tokens
  (`num_groups`: the KV manager's tables per request, 1 but for hybrid KV groups): on add its
  `max_total_tokens` is capped by the KV capacity too, so a request alone in the engine always fits.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from itertools import repeat

from engine_svc.kv.events import KVEventLog
from engine_svc.kv.hybrid_manager import HybridKVCacheManager
from engine_svc.kv.kv_cache_manager import KVCacheManager
from engine_svc.kv_transfer.connector import KVConnector, plan_load
from engine_svc.request import Request, RequestStatus
from engine_svc.sched.lora_budget import LoRABudget, adapter_counts
from engine_svc.sched.lora_keys import lora_block_keys
from engine_svc.sched.output import (
    PLACEHOLDER_TOKEN,
    CachedRequestData,
    GrammarBitmask,
    KVBlockLoad,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from engine_svc.sched.request_queue import make_request_queue
from engine_svc.spec.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from engine_svc.spec.proposers import PENDING_DRAFT, make_proposer
from engine_svc.spec.stats import SpecDecodeStats
from engine_svc.structured.bitmask import BitmaskFiller
from engine_svc.structured.compiler import GrammarCompilers, GrammarError
from engine_svc.structured.grammar import RequestGrammar
from engine_svc.validation import request_problem
from shared_runtime.contract import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineError,
    ErrorCode,
    EventType,
    SchedulerStats,
    TokenLogprobs,
)

SampledLogprobs = tuple[float, int, list[int], list[float]]
_PLACES = [[PENDING_DRAFT] * k for k in range(MAX_SPECULATIVE_TOKENS + 1)]  # shared, never mutated


class Scheduler:
    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        block_size: int,
        num_blocks: int,
        enable_prefix_caching: bool = True,
        policy: str = "fcfs",
        vocab_size: int | None = None,
        long_prefill_token_threshold: int = 0,
        kv_events: KVEventLog | None = None,
        grammars: GrammarCompilers | None = None,
        async_scheduling: bool = False,
        speculative: SpeculativeConfig | None = None,
        lora_ids: Mapping[str, int] | None = None,
        max_loras: int = 1,
        kv_connector: KVConnector | None = None,
        sliding_window: int | None = None,
        kv_group_windows: tuple[int | None, ...] | None = None,
    ) -> None:
        """`sliding_window`: the window every attention layer shares; the KV cache frees blocks behind it
        (engine_svc/kv/kv_cache_manager.py). `kv_group_windows`: a hybrid model's KV groups' windows, one
        block table per group (engine_svc/kv/hybrid_manager.py). Neither with `kv_connector`: blocks
        handed to another engine must hold the whole prompt."""
        if (sliding_window is not None or kv_group_windows is not None) and kv_connector is not None:
            raise ValueError("sliding-window KV freeing cannot be combined with a KV connector")
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_model_len", max_model_len),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.policy = policy
        self.kv: KVCacheManager | HybridKVCacheManager
        if kv_group_windows is not None:
            self.kv = HybridKVCacheManager(num_blocks, block_size, kv_group_windows, enable_prefix_caching,
                                           kv_events)
        else:
            self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching, kv_events, sliding_window)
        self.waiting = make_request_queue(policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every waiting or running request
        self.num_preemptions = 0  # cumulative
        # For the next SchedulerOutput: requests that ended / were preempted since the last one.
        self._finished_ids: list[str] = []
        self._preempted_ids: list[str] = []
        # For the next EngineCoreOutputs: aborted and rejected requests.
        self._terminal_outputs: list[EngineCoreOutput] = []
        self.vocab_size = vocab_size  # when set, prompt token ids must lie in [0, vocab_size)
        # What the workers hold of each request: tokens and blocks sent so far. Absent = send in full.
        self._num_tokens_sent: dict[str, int] = {}
        self._num_blocks_sent: dict[str, int] = {}
        self._last_step = (0, 0, 0)  # scheduled, prompt, sampled tokens in the last updated step
        # Structured outputs: the compilers (None: constraints are refused), requests waiting for theirs.
        self.grammars = grammars
        self._compiling: dict[str, Request] = {}
        self._num_constrained = 0  # live requests holding a matcher: 0 = no step pays for the bitmask
        self._bitmask = BitmaskFiller(grammars.vocab_size) if grammars is not None else None
        # Steps in flight: schedule() numbers its outputs; update_from_output records the last it applied.
        # Without them (`steps_in_flight` False: the core's queue holds one batch) no request ever has a
        # sample in flight when scheduled, and the per-request bookkeeping below is skipped.
        self.async_scheduling = async_scheduling
        self.steps_in_flight = async_scheduling
        self._step_id = 0
        self._last_updated_step = 0
        self._stale: dict[str, int] = {}  # ended request id -> last step that scheduled it, while in flight
        # Speculative decoding (engine_svc/spec/): drafts proposed after each step, verified in the next.
        # Under async scheduling the scheduler only reserves draft places; the workers propose the drafts.
        self.speculative = speculative
        self._spec_async = speculative is not None and async_scheduling
        self._proposer = make_proposer(speculative) if speculative is not None and not async_scheduling else None
        self._verified_extra = 0  # tokens beyond the first in this step's verified outputs
        self.spec_stats = SpecDecodeStats(speculative.num_speculative_tokens if speculative else 0)
        # LoRA (--enable-lora): adapter name -> id, and the per-step adapter budget; None when LoRA is off.
        self.lora_ids = dict(lora_ids) if lora_ids is not None else None
        self.lora_fingerprints: dict[str, str] = {}  # name -> content fingerprint (the registry keeps it)
        # Ids loaded at run time that not every worker holds yet (the registry adds, the workers' step outputs
        # remove): their requests wait, in their place in line, without holding up the requests behind them.
        self.lora_not_ready: set[int] = set()
        self.lora_budget = LoRABudget(max_loras) if lora_ids is not None else None
        # P/D disaggregation: the connector (None: no K/V moves between engines), requests pulling K/V,
        # and the pulled blocks the next SchedulerOutput carries.
        self.kv_connector = kv_connector
        self._loading: dict[str, Request] = {}
        self._kv_loads: list[KVBlockLoad] = []

    # ---- inputs ------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request, or finish it right away with an INVALID_ARGUMENT error if it can never run
        (the error output comes with the next `update_from_output`)."""
        problem = self._why_unservable(request)
        if problem is not None:
            request.status = RequestStatus.FINISHED_ERROR
            self._emit_terminal(request, EngineError(code=ErrorCode.INVALID_ARGUMENT, message=problem))
            return
        request.max_total_tokens = min(request.max_total_tokens,
                                       self.kv.num_blocks // self.kv.num_groups * self.block_size)
        request.set_stop_tokens()
        if request.lora_name and self.lora_ids is not None:
            request.lora_id = self.lora_ids[request.lora_name]
            request.lora_fingerprint = self.lora_fingerprints.get(request.lora_name, "")
            request.block_hash_extra_keys = lora_block_keys(request, self.lora_fingerprints)
        self.kv.hash_blocks(request)
        self.requests[request.request_id] = request
        constraint = request.sampling_params.structured_outputs
        if constraint is not None and self.grammars is not None:
            request.status = RequestStatus.WAITING_FOR_FSM
            request.grammar_ticket = self.grammars.submit(constraint)
            self._compiling[request.request_id] = request
            return
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        """Into `waiting` - or, when its prompt's K/V is to be pulled first, into `_loading`."""
        if self.kv_connector is not None and self.kv_connector.wants_load(request):
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            self.kv_connector.start_load(request, self.kv.get_computed_blocks(request)[1])
            self._loading[request.request_id] = request
            return
        self.waiting.add(request)

    def finish_requests(
        self, request_ids: str | Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED,
        error: EngineError | None = None,
    ) -> None:
        """End waiting or running requests (abort); unknown ids are ignored. Each gets a terminal output
        (carrying `error`, if given) with the next `update_from_output`."""
        if not status.is_finished:
            raise ValueError(f"{status.name} is not a finished status")
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        if self.kv_connector is not None:
            self.kv_connector.release(ids)  # a finished prefill's kept blocks
        for request_id in ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_FSM:
                del self._compiling[request_id]
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                del self._loading[request_id]
                self.kv_connector.cancel_load(request_id)  # type: ignore[union-attr]
            else:
                self.waiting.remove(request)
            request.status = status
            self._release(request)
            self._emit_terminal(request, error)

    # ---- scheduling ----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens (running first, then admissions); see the module docstring."""
        if self._compiling:
            self._admit_compiled()
        if self.kv_connector is not None:
            self._kv_transfer_turn(self.kv_connector)
        self._step_id += 1
        scheduled: dict[str, int] = {}  # request id -> tokens this step, in schedule order
        grown: set[str] = set()  # running requests whose block table grew this step
        cap = self._prefill_cap()
        budget, preempted = self._schedule_running(scheduled, grown, self.max_num_batched_tokens, cap)
        if not preempted:
            self._schedule_waiting(scheduled, budget, cap)
        grammar = None
        if self._bitmask is not None and self._num_constrained:
            grammar = self._grammar_bitmask(scheduled, self._bitmask)  # reads the pre-step counts
        output = self._make_output(scheduled, grown)  # advances num_computed_tokens
        output.grammar = grammar
        return output

    def _prefill_cap(self) -> int:
        """Tokens one request may get this step: `long_prefill_token_threshold` while a running request
        is decoding (its prompt computed), else the whole budget."""
        threshold = self.long_prefill_token_threshold
        if threshold > 0 and any(r.num_computed_tokens >= r.num_prompt_tokens for r in self.running):
            return threshold
        return self.max_num_batched_tokens

    def _admit_compiled(self) -> None:
        """Requests whose grammar is ready join `waiting` with their matcher; a constraint that did not
        compile (or not within the compilers' timeout) ends its request with INVALID_ARGUMENT."""
        assert self.grammars is not None
        for request in [r for r in self._compiling.values() if _compile_settled(r)]:
            ticket = request.grammar_ticket
            assert ticket is not None
            del self._compiling[request.request_id]
            try:
                if not ticket.done:
                    raise GrammarError(f"the constraint did not compile within {self.grammars.timeout_s:g} s")
                request.grammar = _grammar_after_outputs(
                    RequestGrammar(self.grammars.result(ticket), sorted(request.eos_token_ids)), request)
                self._num_constrained += 1
            except GrammarError as exc:
                request.status = RequestStatus.FINISHED_ERROR
                self._release(request)
                self._emit_terminal(request, EngineError(
                    code=ErrorCode.INVALID_ARGUMENT, message=f"sampling_params.structured_outputs: {exc}"))
                continue
            self.grammars.release(ticket)
            request.grammar_ticket = None
            request.status = RequestStatus.WAITING
            self._enqueue(request)

    def fail_lora(self, lora_id: int, why: str) -> None:
        """The workers could not read adapter `lora_id` (loaded at run time): its requests, which never ran
        (it was not ready), end with an error naming the adapter."""
        self.lora_not_ready.discard(lora_id)
        for request in [r for r in self.requests.values() if r.lora_id == lora_id]:
            self.finish_requests(request.request_id, RequestStatus.FINISHED_ERROR, EngineError(
                code=ErrorCode.INVALID_ARGUMENT,
                message=f"lora_name: the engine's workers could not read LoRA adapter {request.lora_name!r}: {why}"))

    def _kv_transfer_turn(self, connector: KVConnector) -> None:
        """Free the blocks of leases that ended; move requests whose pull ended into `waiting` (a failed
        pull: without K/V under the `recompute` policy, else the request ends with UNAVAILABLE)."""
        for ended in connector.take_ended():
            self.kv.free(ended)
        for result in connector.take_loaded():
            request = self._loading.pop(result.request_id, None)
            if request is None:
                continue  # aborted meanwhile
            if result.data is None and not connector.recompute_on_failure:
                request.status = RequestStatus.FINISHED_ERROR
                self._release(request)
                self._emit_terminal(request, EngineError(code=ErrorCode.UNAVAILABLE, message=(
                    f"kv_transfer_params: {result.error} (kv_load_failure_policy is 'fail')")))
                continue
            request.kv_load = result if result.data is not None else None
            request.status = RequestStatus.WAITING
            self.waiting.add(request)

    def _grammar_bitmask(self, scheduled: dict[str, int], filler: BitmaskFiller) -> GrammarBitmask | None:
        """The bitmask rows of the constrained requests that sample this step (before the advance of
        num_computed_tokens: a request samples when its scheduled tokens reach its last known token)."""
        ids: list[str] = []
        grammars: list[RequestGrammar] = []
        drafts: list[list[int]] = []
        for request_id, n in scheduled.items():
            request = self.requests[request_id]
            if request.grammar is not None and request.num_computed_tokens + n >= request.num_tokens:
                ids.append(request_id)
                grammars.append(request.grammar)
                drafts.append(request.spec_token_ids[: request.num_computed_tokens + n - request.num_tokens])
        return filler.fill(ids, grammars, drafts) if ids else None

    def _schedule_running(self, scheduled: dict[str, int], grown: set[str], budget: int,
                          cap: int) -> tuple[int, bool]:
        """Returns (budget left, whether anything was preempted). Adds to `grown` the scheduled requests
        that got blocks (the others' tables are as the workers last saw them)."""
        preempted = False
        i = 0
        running, max_model_len, allocate = self.running, self.max_model_len, self.kv.allocate_slots
        async_, in_flight, spec_async = self.async_scheduling, self.steps_in_flight, self._spec_async
        while i < len(running) and budget > 0:
            request = running[i]
            n = len(request.all_token_ids)
            if in_flight and request.num_output_placeholders:  # a sample in flight (see the module docstring)
                placeholders = request.num_output_placeholders
                if not async_ or n + placeholders >= request.max_total_tokens or request.grammar is not None:
                    i += 1
                    continue
                n += placeholders
                if spec_async:
                    n += self._draft_places(request, n)
            elif spec_async:
                n += self._draft_places(request, n)
            elif request.spec_token_ids and n - request.num_computed_tokens == 1:
                n += len(request.spec_token_ids)  # a decode verifying drafts: 1 + k tokens
            if n > max_model_len:  # (a compare, not a min() call: this runs per request per step)
                n = max_model_len
            n -= request.num_computed_tokens
            if n > budget or n > cap:  # (a decode never is: two compares instead of a min() call)
                n = min(n, budget, cap)
            if n <= 0:  # nothing left below max_model_len: never send 0 tokens
                i += 1
                continue
            new_blocks = allocate(request, n)
            while new_blocks is None:
                victim = self._pick_victim()
                preempted = True
                if self.running.index(victim) < i:  # already scheduled this step: undo that
                    budget += scheduled.pop(victim.request_id, 0)  # 0: it was skipped with nothing to run
                    i -= 1
                self._preempt(victim)
                if victim is request:
                    return budget, True
                new_blocks = allocate(request, n)
            if new_blocks:
                grown.add(request.request_id)
            scheduled[request.request_id] = n
            budget -= n
            i += 1
        return budget, preempted

    def _schedule_waiting(self, scheduled: dict[str, int], budget: int, cap: int) -> None:
        loras = self.lora_budget
        if loras is not None:
            loras.begin_step(self.running)
        skipped: list[Request] = []  # adapter requests over the step's LoRA budget, back in line afterwards
        while len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            if request.last_scheduled_step > self._last_updated_step:
                break  # preempted while a step that holds it is in flight: its output comes first
            if request.lora_id in self.lora_not_ready or (loras is not None and not loras.admits(request)):
                skipped.append(self.waiting.pop())
                continue
            hit_blocks, num_hit_tokens = self.kv.get_computed_blocks(request)
            load = request.kv_load
            num_pulled = 0
            if load is not None:
                plan = plan_load(load, num_hit_tokens, request.num_tokens, self.block_size)
                num_pulled = plan.num_tokens
            n = min(request.num_tokens - num_hit_tokens - num_pulled, budget, cap)
            if self.kv.allocate_slots(request, num_pulled + n, hit_blocks) is None:
                break
            self.waiting.pop()
            if load is not None:
                request.kv_load = None
                if num_pulled:
                    block_ids = self.kv.get_block_ids(request.request_id, plan.first_block)[:plan.num_blocks]
                    self._kv_loads.append(KVBlockLoad(block_ids, plan.data))
            request.num_computed_tokens = num_hit_tokens + num_pulled
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            request.record_event(EventType.SCHEDULED)
            self.running.append(request)
            scheduled[request.request_id] = n
            budget -= n
            if loras is not None:
                loras.admitted(request)
        for request in reversed(skipped):
            self.waiting.prepend(request)

    def _pick_victim(self) -> Request:
        if self.policy != "priority":
            return self.running[-1]
        worst = max(
            range(len(self.running)),
            key=lambda i: (self.running[i].priority, self.running[i].arrival_time, i),
        )
        return self.running[worst]

    def _preempt(self, request: Request) -> None:
        """Recompute-preemption: give back the blocks and requeue at the head (fcfs) / by key."""
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.spec_token_ids = []
        request.record_event(EventType.PREEMPTED)
        if not request.first_token_sent and not request.num_output_placeholders:
            request.prompt_logprobs.clear()  # the prompt will be run (and its logprobs sent) again
        self.num_preemptions += 1
        self._forget_sent(request.request_id)
        self._preempted_ids.append(request.request_id)
        self.waiting.prepend(request)

    def _make_output(self, scheduled: dict[str, int], grown: set[str]) -> SchedulerOutput:
        """The step's SchedulerOutput (new requests in full, the others as diffs against what the workers
        hold), then each scheduled request's `num_computed_tokens` advanced by its tokens.

        The advance comes only now, after every preemption of this step: the KV manager caches blocks when
        it allocates them and, when a request is freed, uncaches its blocks past `num_computed_tokens` -
        for a request undone in this step those are blocks whose K/V will never be written. The diffs
        carry the pre-step count.

        `grown`: the running requests that got blocks this step. The workers hold every block of every
        other request already (blocks are only added by this step's allocations, and each is sent in the
        step that adds it), so those skip the look at their block table.
        """
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        decode_ids: list[str] = []  # steady decodes (one token appended, no block): columnar
        decode_tokens: list[int] = []
        decode_computed: list[int] = []
        prompt_tokens: dict[str, int] = {}
        spec_tokens: dict[str, list[int]] = {}
        requests, tokens_sent_of, blocks_sent_of = self.requests, self._num_tokens_sent, self._num_blocks_sent
        kv, step_id, in_flight, spec_async = self.kv, self._step_id, self.steps_in_flight, self._spec_async
        for request_id, n in scheduled.items():
            request = requests[request_id]
            tokens = request.all_token_ids
            num_tokens = len(tokens)
            # Past num_tokens only under async scheduling: the tokens in flight. The workers get one
            # placeholder per sampling step in flight (`sent`): a verifying step's whole run is one.
            horizon = num_tokens + request.num_output_placeholders if in_flight else num_tokens
            sent = horizon - request.num_spec_in_flight
            tokens_sent = tokens_sent_of.get(request_id)
            if tokens_sent is None:
                new_reqs.append(self._new_request_data(request))
                blocks_sent_of[request_id] = len(new_reqs[-1].block_ids)
            else:
                one_token = tokens_sent == sent - 1
                new_blocks = ([] if one_token and request_id not in grown
                              else kv.get_block_ids(request_id, blocks_sent_of[request_id]))
                if one_token and not new_blocks:
                    decode_ids.append(request_id)
                    decode_tokens.append(tokens[-1] if sent == num_tokens else PLACEHOLDER_TOKEN)
                    decode_computed.append(request.num_computed_tokens)
                else:
                    new_tokens = tokens[tokens_sent:]
                    if sent > num_tokens:
                        new_tokens += [PLACEHOLDER_TOKEN] * (sent - max(tokens_sent, num_tokens))
                    cached_reqs.append(
                        CachedRequestData(
                            req_id=request_id,
                            new_token_ids=new_tokens,
                            new_block_ids=new_blocks,
                            num_computed_tokens=request.num_computed_tokens,
                        )
                    )
                    if new_blocks:
                        blocks_sent_of[request_id] += len(new_blocks)
            tokens_sent_of[request_id] = sent
            start = request.num_computed_tokens
            if start < len(request.prompt_token_ids):
                prompt_tokens[request_id] = min(len(request.prompt_token_ids) - start, n)
            request.num_computed_tokens = start + n
            num_places = start + n - horizon  # drafts scheduled past the known tokens (and those in flight)
            if request.spec_token_ids and num_places > 0:
                spec_tokens[request_id] = request.spec_token_ids[:num_places]
            if in_flight:
                request.last_scheduled_step = step_id
                if num_places >= 0:  # it samples this step: one token, and as many as its drafts accepted
                    if num_places and spec_async:
                        request.num_output_placeholders += 1 + num_places
                        request.num_spec_in_flight += num_places
                    else:
                        request.num_output_placeholders += 1
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            finished_req_ids=self._finished_ids,
            preempted_req_ids=self._preempted_ids,
            num_prompt_tokens=prompt_tokens,
            decode_req_ids=decode_ids,
            decode_token_ids=decode_tokens,
            decode_num_computed_tokens=decode_computed,
            step_id=step_id,
            scheduled_spec_decode_tokens=spec_tokens,
        )
        self._finished_ids, self._preempted_ids = [], []
        if self._kv_loads:
            output.kv_loads, self._kv_loads = self._kv_loads, []
        return output

    def _new_request_data(self, request: Request) -> NewRequestData:
        return NewRequestData(
            req_id=request.request_id,
            token_ids=list(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params,
            block_ids=self.kv.get_block_ids(request.request_id),
            num_computed_tokens=request.num_computed_tokens,
            eos_token_ids=sorted(request.eos_token_ids),
            lora_id=request.lora_id,
        )

    # ---- results -------------------------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Apply one step's results. Also works with an empty SchedulerOutput and ModelRunnerOutput, to
        emit pending abort / rejection outputs when nothing ran."""
        outputs, self._terminal_outputs = self._terminal_outputs, []
        step = scheduler_output.step_id
        if step > self._last_updated_step:
            self._last_updated_step = step
        stale = self._stale  # empty unless a request ended while a step held it (steps in flight)
        num_prompt_tokens = self._count_prompt_tokens(scheduler_output)
        for request_id, rows in model_runner_output.prompt_logprobs.items():
            request = self.requests.get(request_id)
            if request is None or request.first_token_sent or (stale and stale.get(request_id, -1) >= step):
                continue
            # A request preempted since holds rows only when this step also samples its first token (its
            # rows were kept); otherwise its prompt is computed again, rows and all.
            if request.status == RequestStatus.RUNNING or request.num_output_placeholders:
                request.prompt_logprobs.extend(_token_logprobs(row[0], row[1:]) for row in rows)

        num_terminal, num_finished = len(outputs), len(self._finished_ids)
        logprobs = model_runner_output.logprobs
        requests, running, on_sampled = self.requests, RequestStatus.RUNNING, self._on_sampled
        in_flight = self.steps_in_flight
        runs = model_runner_output.spec_token_ids  # verified requests' tokens (several per request)
        for request_id, token, row in zip(model_runner_output.req_ids, model_runner_output.sampled_token_ids,
                                          repeat(None) if logprobs is None else logprobs):
            if token < 0:
                continue  # a partial prefill chunk
            request = requests.get(request_id)
            if request is None or (stale and stale.get(request_id, -1) >= step):
                continue  # ended (aborted, or finished by a token of an earlier step) since it was scheduled
            if runs and request_id in runs:
                outputs.append(self._on_verified(request, scheduler_output.scheduled_spec_decode_tokens[request_id],
                                                 runs[request_id], model_runner_output.spec_logprobs.get(request_id),
                                                 step, model_runner_output.spec_num_drafts.get(request_id)))
                continue
            if not in_flight:
                outputs.append(on_sampled(request, token, row))
                continue
            request.num_output_placeholders -= 1
            preempted = request.status is not running  # since this step was scheduled: the token stands
            outputs.append(on_sampled(request, token, row))
            if preempted and request.is_finished:
                self.waiting.remove(request)
        num_sampled = len(outputs) - num_terminal + self._verified_extra  # one output per sampled request
        self._verified_extra = 0
        if len(self._finished_ids) > num_finished:  # `_release` lists every request it ends
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        if stale:
            for request_id in [r for r, last in stale.items() if last <= step]:
                del stale[request_id]
        if self._proposer is not None:  # (under async scheduling, places are reserved in `schedule`)
            self._propose_drafts()

        self._last_step = (scheduler_output.total_num_scheduled_tokens, num_prompt_tokens, num_sampled)
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.get_stats())

    def _on_sampled(self, request: Request, token: int, logprobs: SampledLogprobs | None) -> EngineCoreOutput:
        """Append one sampled token to a running request and build its output (finishing it when it
        stops). Runs once per running request per step: no work beyond the checks a plain decode needs."""
        if request.grammar is not None and not request.grammar.accept(token):
            return self._grammar_violated(request, token)
        request.output_token_ids.append(token)
        tokens = request.all_token_ids
        tokens.append(token)
        num_tokens = len(tokens)
        if num_tokens // self.block_size > len(request.block_hashes) and self.kv.enable_prefix_caching:
            self.kv.hash_blocks(request)  # a block just filled
            if self.async_scheduling:
                self.kv.cache_late_blocks(request)  # it may have been filled by this token's placeholder
        num_cached = request.num_cached_tokens  # -1 until first scheduled; a compare costs less than max()
        output = EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=[token],
            num_cached_tokens=num_cached if num_cached > 0 else 0,
        )
        if logprobs is not None:
            output.new_logprobs = [_token_logprobs(token, logprobs)]
        if not request.first_token_sent:
            request.first_token_sent = True
            request.record_event(EventType.FIRST_TOKEN)
            output.prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, []
        if (token in request.stop_token_set or num_tokens >= request.max_total_tokens) and self._check_stop(
            request, token
        ):
            self._release(request)
            request.record_event(EventType.FINISHED)
            output.finish_reason = request.finish_reason
            output.stop_token_id = request.stop_token_id
            output.kv_transfer_params = request.kv_transfer_out
        if request.pending_events:  # else the output keeps its own empty list
            output.events, request.pending_events = request.pending_events, []
        return output

    def _on_verified(self, request: Request, drafts: list[int], run: list[int],
                     logprobs: list[SampledLogprobs] | None, step: int, num_drafts: int | None) -> EngineCoreOutput:
        """Apply a verification of step `step`: `drafts` are the draft places scheduled, `run` the
        accepted drafts then the token the target sampled. The rejected drafts' positions are given back
        first (their K/V is garbage: computed again next step, their slots reused), then the tokens are
        appended one by one with every stop check, and the ones after a stop are dropped. One output
        carries them all. `num_drafts`: the drafts the workers proposed into the places (fewer when
        prompt lookup found fewer; None: as many as places), for the acceptance counters.

        Under async scheduling the step's 1 + k placeholders are given back too; a step scheduled since
        (still in flight) was laid out as if every place were accepted: the workers correct its positions
        themselves, and here `num_computed_tokens` loses the rejected places, which makes it exact for the
        step in flight. When that step carried the placeholder standing for this run, the workers hold the
        whole run (`_num_tokens_sent` grows by the accepted drafts); otherwise the next diff sends it."""
        num_accepted = len(run) - 1
        num_rejected = len(drafts) - num_accepted
        preempted = False
        if self.steps_in_flight and request.num_output_placeholders:  # async: this step's places in flight
            request.num_output_placeholders -= len(drafts) + 1
            request.num_spec_in_flight -= len(drafts)
            preempted = request.status is not RequestStatus.RUNNING  # since scheduled: the run stands
            if request.last_scheduled_step > step and request.request_id in self._num_tokens_sent:
                self._num_tokens_sent[request.request_id] += num_accepted  # one placeholder sent for the run
        request.spec_token_ids = []
        if not preempted:
            request.num_computed_tokens -= num_rejected
        drafted = len(drafts) if num_drafts is None else num_drafts
        if drafted:  # places the workers found no draft for are no verification (as unproposed ones)
            self.spec_stats.observe(drafted, num_accepted)
        output = self._on_sampled(request, run[0], logprobs[0] if logprobs else None)
        for i in range(1, len(run)):
            if request.is_finished:
                break
            more = self._on_sampled(request, run[i], logprobs[i] if logprobs else None)
            output.new_token_ids.extend(more.new_token_ids)
            if more.new_logprobs:
                output.new_logprobs.extend(more.new_logprobs)
            output.finish_reason, output.stop_token_id = more.finish_reason, more.stop_token_id
            if more.events:
                output.events = [*output.events, *more.events]
        self._verified_extra += len(output.new_token_ids) - 1
        if preempted and request.is_finished:
            self.waiting.remove(request)
        elif not request.is_finished and self.kv.enable_prefix_caching and not preempted:
            self.kv.cache_late_blocks(request)  # blocks the accepted tokens filled (allocated with drafts)
        return output

    def _draft_places(self, request: Request, horizon: int) -> int:
        """Async speculation: the draft places a running request gets this step (0 unless it decodes
        next, every token up to `horizon` computed but the last), as `spec_token_ids`. Capped so that
        the run cannot pass max_total_tokens even if every place in flight is accepted; none for a
        constrained request (its bitmask rows need the drafts) and none in a step with
        `disable_by_batch_size` or more requests running."""
        spec = self.speculative
        assert spec is not None
        k = min(spec.num_speculative_tokens, request.max_total_tokens - horizon - 1)
        if (k <= 0 or request.num_computed_tokens != horizon - 1 or request.grammar is not None
                or (spec.disable_by_batch_size is not None and len(self.running) >= spec.disable_by_batch_size)):
            request.spec_token_ids = []
            return 0
        request.spec_token_ids = _PLACES[k]
        return k

    def _propose_drafts(self) -> None:
        """Drafts for each running request that may speculate and decodes next step (its known tokens
        all computed but the last), capped so that its run cannot pass max_total_tokens. None in a step
        with `disable_by_batch_size` or more requests running."""
        spec, proposer = self.speculative, self._proposer
        assert spec is not None and proposer is not None
        if spec.disable_by_batch_size is not None and len(self.running) >= spec.disable_by_batch_size:
            for request in self.running:
                request.spec_token_ids = []
            return
        for request in self.running:
            tokens = request.all_token_ids
            k = min(spec.num_speculative_tokens, request.max_total_tokens - len(tokens) - 1)
            if k <= 0 or request.num_computed_tokens != len(tokens) - 1:
                request.spec_token_ids = []
                continue
            drafts = proposer.propose(tokens, k)
            if request.grammar is not None:  # only drafts the grammar allows (none from a draft model)
                drafts = drafts[: request.grammar.allowed_drafts(drafts)]
            request.spec_token_ids = drafts

    def _grammar_violated(self, request: Request, token: int) -> EngineCoreOutput:
        """The sampled token is outside the grammar: only possible when another setting masked every
        token the grammar allowed (min_tokens or a stop token id holding back the end it required)."""
        request.status = RequestStatus.FINISHED_ERROR
        self._release(request)
        request.record_event(EventType.FINISHED)
        output = EngineCoreOutput(
            request_id=request.request_id, finish_reason=request.finish_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            error=EngineError(code=ErrorCode.INVALID_ARGUMENT, message=(
                f"sampling_params.structured_outputs: token {token} is not allowed by the grammar here; the "
                "other sampling settings (min_tokens, logit_bias) left no token the grammar allows")))
        output.events, request.pending_events = request.pending_events, []
        return output

    @staticmethod
    def _check_stop(request: Request, token: int) -> bool:
        """EOS / stop token (not before min_tokens outputs), then the length limit. Sets the status."""
        if token in request.stop_token_set and request.num_output_tokens >= request.sampling_params.min_tokens:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_token_id = token
            return True
        if request.num_tokens >= request.max_total_tokens:
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def _count_prompt_tokens(self, scheduler_output: SchedulerOutput) -> int:
        """Prompt tokens among this step's scheduled tokens, of the requests still known (not aborted
        since): `_make_output` counted them per request."""
        requests = self.requests
        return sum(n for request_id, n in scheduler_output.num_prompt_tokens.items() if request_id in requests)

    # ---- bookkeeping ---------------------------------------------------------------------------------
    def _release(self, request: Request) -> None:
        """Forget a request that has just finished (its status is already final) and free its blocks - or,
        a producer's prefill that asked for it, keep them under a lease (`kv_transfer_out` says where)."""
        connector = self.kv_connector
        if connector is not None and connector.wants_hold(request):
            request.kv_transfer_out = connector.hold(request, self.kv.get_block_ids(request.request_id))
        else:
            self.kv.free(request)
        del self.requests[request.request_id]
        if request.grammar_ticket is not None:
            assert self.grammars is not None
            self.grammars.release(request.grammar_ticket)
            request.grammar_ticket = None
        if request.grammar is not None:
            request.grammar = None
            self._num_constrained -= 1
        self.waiting.forget(request.request_id)
        self._forget_sent(request.request_id)
        self._finished_ids.append(request.request_id)
        if request.last_scheduled_step > self._last_updated_step:  # a step in flight still holds it
            self._stale[request.request_id] = request.last_scheduled_step

    def _forget_sent(self, request_id: str) -> None:
        self._num_tokens_sent.pop(request_id, None)
        self._num_blocks_sent.pop(request_id, None)

    def _emit_terminal(self, request: Request, error: EngineError | None = None) -> None:
        request.record_event(EventType.FINISHED)
        events, request.pending_events = request.pending_events, []
        self._terminal_outputs.append(
            EngineCoreOutput(
                request_id=request.request_id,
                finish_reason=request.finish_reason,
                num_cached_tokens=max(request.num_cached_tokens, 0),
                events=events,
                error=error,
            )
        )

    def _why_unservable(self, request: Request) -> str | None:
        problem = request_problem(request, self.vocab_size)  # ids, sampling values, sizes (validation.py)
        if problem is not None:
            return problem
        if request.lora_name and (self.lora_ids is None or request.lora_name not in self.lora_ids):
            served = ", ".join(self.lora_ids or ()) or "none: the engine runs without --enable-lora"
            return f"lora_name: unknown LoRA adapter {request.lora_name[:128]!r} (this engine serves {served})"
        if request.sampling_params.structured_outputs is not None and self.grammars is None:
            return "structured outputs are not available on this engine (it has no grammar compiler)"
        n = request.num_prompt_tokens
        if request.request_id in self.requests:
            return f"request id {request.request_id!r} is already in use"
        if self.kv_connector is not None and self.kv_connector.holds(request.request_id):
            return f"request id {request.request_id!r} is already in use (its K/V is kept for a pull)"
        if n == 0:
            return "the prompt is empty"
        if n > self.max_model_len:
            return f"the prompt has {n} tokens, more than max_model_len ({self.max_model_len})"
        if self.vocab_size is not None:
            bad = next((t for t in request.all_token_ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                return f"token id {bad} (prompt or output_token_ids) is outside the vocabulary [0, {self.vocab_size})"
        outputs = request.num_output_tokens
        if outputs:
            if request.num_tokens > self.max_model_len:
                return (f"the prompt and its earlier output have {request.num_tokens} tokens, more than "
                        f"max_model_len ({self.max_model_len})")
            if request.num_tokens >= request.max_total_tokens:
                return f"output_token_ids: the request already has its {outputs} output tokens (max_tokens)"
            n = request.num_tokens
        blocks = -(-n // self.block_size) * self.kv.num_groups
        if blocks > self.kv.num_blocks:
            return (
                f"the prompt needs {blocks} KV-cache blocks of {self.block_size} tokens, more than the "
                f"whole cache ({self.kv.num_blocks} blocks)"
            )
        return None

    # ---- state -----------------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        """True while anything is waiting, running, or an abort / rejection output is still to be sent."""
        return (bool(self.running) or len(self.waiting) > 0 or bool(self._terminal_outputs)
                or bool(self._compiling) or bool(self._loading))

    def has_work(self) -> bool:
        """True when a step would do something now: `has_unfinished_requests`, except that requests whose
        grammar is still compiling (and not past its timeout) or whose K/V is still being pulled give a step
        nothing to do; a pull or a lease that ended does (the step admits / frees it)."""
        return (bool(self.running) or len(self.waiting) > 0 or bool(self._terminal_outputs)
                or any(_compile_settled(r) for r in self._compiling.values())
                or (self.kv_connector is not None and self.kv_connector.has_ready()))

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self._compiling) + len(self._loading)

    def get_stats(self, with_step: bool = True) -> SchedulerStats:
        """Current load and cumulative counters; the per-step token counts are those of the step last
        passed to `update_from_output` (zero without `with_step`: a report that applied no step)."""
        num_scheduled, num_prompt, num_generated = self._last_step if with_step else (0, 0, 0)
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=self.num_waiting,
            kv_cache_usage=self.kv.usage,
            num_free_blocks=self.kv.num_free_blocks,
            num_total_blocks=self.kv.num_blocks,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            spec_decode_num_drafts=self.spec_stats.num_drafts,
            spec_decode_num_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec_stats.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(self.spec_stats.accepted_per_pos),
            num_scheduled_tokens=num_scheduled,
            num_prompt_tokens=num_prompt,
            num_generation_tokens=num_generated,
            running_lora_adapters=adapter_counts(self.running) if self.lora_ids is not None else {},
            waiting_lora_adapters=adapter_counts(self.waiting) if self.lora_ids is not None else {},
        )


def _compile_settled(request: Request) -> bool:
    """Its grammar compiled (or failed), or it waited past the compilers' timeout."""
    ticket = request.grammar_ticket
    return ticket is None or ticket.done or ticket.expired


def _token_logprobs(token_id: int, row: tuple[float, int, list[int], list[float]]) -> TokenLogprobs:
    logprob, rank, top_ids, top_logprobs = row
    return TokenLogprobs(
        token_id=token_id, logprob=logprob, rank=rank, top_token_ids=top_ids, top_logprobs=top_logprobs
    )


def _grammar_after_outputs(grammar: RequestGrammar, request: Request) -> RequestGrammar:
    """`grammar` advanced through a continuation's earlier output (a new request has none), so that it has
    accepted exactly the request's output tokens; GrammarError if they do not follow the constraint."""
    for token in request.output_token_ids:
        if not grammar.accept(token):
            raise GrammarError(f"output_token_ids do not follow the constraint (token {token} is refused)")
    return grammar
