"""One generation request from admission to its end, the same for every API in front of it.

The gRPC servicer (grpc_api/servicer.py) and the OpenAI-compatible HTTP API both do exactly this:

    generation = frontend.open_generation(n, call)   # admission: ValidationError / ServiceError
    try:
        await generation.start(prepare)              # tokenize off the loop, route, submit
        async for deltas in generation.batches():    # merged per completion for a slow reader
            ...send them...
    finally:
        generation.close()                           # idempotent: aborts what is unfinished

Invariants:
- `Admission` counts completions, not calls: a generation holds n slots from before its prompt is
  tokenized until `close()`, and a prompt still on the tokenizer pool keeps its slots until the pool is
  done with it (so the pool's queue is bounded by the limit too).
- `close()` may run from any callback on the loop (a gRPC done-callback, an HTTP disconnect) and more
  than once; the first call aborts the request's unfinished completions in the engine and gives the
  slots back, later calls do nothing.
- `batches()` ends after every completion's finished delta; an engine error or a lost engine ends it
  with a `ServiceError` carrying the engine's code.
- With `write_directly`, the deltas its writer took never reach `batches()`; every finish and error
  still does, after them, and `close()` turns the writer off.

`GenerationBackend` is everything an API layer may use of the frontend (as vLLM's API server sees only
an `EngineClient`): `FrontendServer` implements it, the OpenAI layer takes nothing else.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol, TypeVar

from tandem.engine.v1 import engine_core_pb2 as epb

from frontend_svc.delta_collector import DeltaCollector
from frontend_svc.dispatcher import Dispatcher
from frontend_svc.engines.client import EngineUnavailable
from frontend_svc.engines.lora_admin import LoraAdmin
from frontend_svc.output_processor import RequestState
from frontend_svc.outputs import CompletionDelta, Usage
from frontend_svc.processor import ChatPrompt, PreparedRequest, Processor, Prompt, PromptOptions
from frontend_svc.service_error import RESOURCE_EXHAUSTED, UNAVAILABLE, ServiceError
from frontend_svc.telemetry.call import GenerateCall
from frontend_svc.tokenizer import Tokenizer
from shared_runtime.contract import SamplingParams
from shared_runtime.security.auth import KeySet
from shared_runtime.violations import ValidationError

T = TypeVar("T")


class GenerationBackend(Protocol):
    """The frontend as an API layer in front of it sees it."""

    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int:
        """The context window requests are validated against (the ready engines' smallest)."""

    @property
    def tokenizer(self) -> Tokenizer:
        """For the text of single tokens (logprobs); prompts go through `process`."""

    @property
    def api_keys(self) -> KeySet | None: ...

    @property
    def serving(self) -> bool:
        """An engine is ready and no drain began."""

    @property
    def draining(self) -> bool: ...

    def check_fits(self, slots: int, field: str) -> None:
        """ValidationError on `field` when `slots` completions could never run at once."""

    @property
    def metrics_registry(self) -> Any:
        """The Prometheus `CollectorRegistry` of the frontend's metrics (None: metrics are off)."""

    @property
    def vocab_size(self) -> int:
        """The model's logits width: token ids must be below it."""

    @property
    def num_ready_engines(self) -> int: ...

    def ready_engine_infos(self) -> list[tuple[str, epb.EngineInfo]]:
        """(address, what it reported in GetEngineInfo) of each ready engine."""

    @property
    def lora_adapters(self) -> tuple[str, ...]:
        """The LoRA adapters the ready engines serve (EngineInfo.lora_adapters), first engine's order first."""

    @property
    def lora_admin(self) -> LoraAdmin:
        """Loads and unloads LoRA adapters on every engine at run time (engines/lora_admin.py)."""

    def begin_call(self, headers: Sequence[tuple[str, str]], method: str,
                   attributes: dict[str, str] | None) -> GenerateCall:
        """One generation call's telemetry (trace context from `headers`; `attributes`: the transport's,
        None for a gRPC method's)."""

    def open_generation(self, num_completions: int, call: GenerateCall) -> Generation:
        """Admit a request of `num_completions` (ValidationError / ServiceError when it cannot be)."""

    async def run_blocking(self, fn: Callable[[Any], T], request: Any) -> T:
        """`fn(request)` on the tokenizer pool under one admission slot (ServiceError while draining or at
        the limit)."""

    def tokenize_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Blocking (through `run_blocking`); ValidationError on `text` when too long for any prompt."""

    def tokenize_chat(self, chat: ChatPrompt, add_special_tokens: bool = False) -> list[int]:
        """Blocking; the chat rendered by its template; ValidationError on `chat.messages`."""

    def detokenize_ids(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Blocking; ValidationError on `token_ids` beyond max_model_len ids or an id >= vocab_size."""

    def process(self, prompt: Prompt, params: SamplingParams, *, request_id: str | None,
                priority: int, options: PromptOptions | None = None) -> PreparedRequest:
        """Tokenize and validate (blocking: run it through `Generation.start`); `options` shape the
        prompt (truncation, special tokens, max_tokens fitted to the context)."""


class Admission:
    """The frontend's concurrency limit, in completions; `idle` is set while nothing holds a slot."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_use = 0
        self.idle = asyncio.Event()
        self.idle.set()

    def check_fits(self, slots: int, field: str) -> None:
        """ValidationError on `field` when one call alone asks for more than the limit (it could never run)."""
        if slots > self.limit:
            raise ValidationError.single(
                field, f"asks for {slots} completions; this server runs at most {self.limit} at a time")

    def take(self, slots: int, field: str) -> None:
        """Hold `slots` or raise: ValidationError (`check_fits`), or ServiceError RESOURCE_EXHAUSTED when
        the limit is reached."""
        self.check_fits(slots, field)
        if self.in_use + slots > self.limit:
            raise ServiceError(RESOURCE_EXHAUSTED, f"too many completions in flight (limit {self.limit}); "
                               "retry later", "TOO_MANY_REQUESTS")
        self.in_use += slots
        self.idle.clear()

    def give_back(self, slots: int, job: concurrent.futures.Future[Any] | None = None) -> None:
        """Release `slots` now, or once `job` (still on the tokenizer pool) is done."""
        if job is not None and not job.done():
            loop = asyncio.get_running_loop()
            job.add_done_callback(lambda _: loop.call_soon_threadsafe(self.give_back, slots))
            return
        self.in_use -= slots
        if self.in_use == 0:
            self.idle.set()


class Generation:
    """An admitted request: `start()`, then `batches()`, and always `close()`."""

    def __init__(self, *, slots: int, call: GenerateCall, admission: Admission, dispatcher: Dispatcher,
                 processor: Processor, pool: concurrent.futures.Executor) -> None:
        self.slots = slots
        self.call = call
        self._admission = admission
        self._dispatcher = dispatcher
        self._processor = processor
        self._pool = pool
        self._collector = DeltaCollector()
        self._preparing: concurrent.futures.Future[PreparedRequest] | None = None
        self._request: RequestState | None = None
        self._closed = False

    async def start(self, prepare: Callable[[], PreparedRequest]) -> PreparedRequest:
        """Tokenize and validate with `prepare` on the tokenizer pool, then send the request to an engine.
        Raises ValidationError for bad input, ServiceError UNAVAILABLE when no engine is ready."""
        self._preparing = self._pool.submit(self.call.prepare, prepare)
        try:
            prepared = await asyncio.wrap_future(self._preparing)
        finally:
            if self._preparing.done():  # its failure's traceback holds this frame, so self: drop the job
                self._preparing = None  # (kept only while the pool still runs it: close() waits for it)
        if self._closed:  # the client left while the prompt was being tokenized
            raise asyncio.CancelledError
        engine_requests = self._processor.engine_requests(prepared, self.call.trace_headers())
        try:
            self._request = self._dispatcher.submit(prepared, engine_requests, self._collector,
                                                    on_migration=self.call.migrated)
        except EngineUnavailable as exc:
            raise ServiceError(UNAVAILABLE, str(exc), "NO_READY_ENGINE") from None
        connection = self._dispatcher.engine_of(self._request)
        self.call.routed(connection.address if connection is not None else "", len(engine_requests))
        return prepared

    async def batches(self) -> AsyncIterator[list[CompletionDelta]]:
        """The request's output: each item holds every completion's output since the previous item (one
        delta per index). Ends once all completions finished; raises ServiceError on failure."""
        request = self._request
        if request is None:
            raise RuntimeError("start() the generation first")
        remaining = len(request.prepared.engine_request_ids)
        while remaining:
            deltas = await self._collector.get()
            for delta in deltas:
                if delta.error is not None:
                    raise ServiceError(delta.error.code, delta.error.message, "ENGINE_ERROR")
                if delta.finish_reason is not None:
                    remaining -= 1
                self.call.on_delta(delta)
            yield deltas
        self._collector.release()

    def write_directly(self, write: Callable[[CompletionDelta], bool]) -> None:
        """Let the processing of engine output write this generation's deltas itself (merged per completion
        over each processed slice) while `batches()`'s reader waits for output (delta_collector.py, the
        sink): `write(delta)` writes the delta's output
        and returns True, or writes nothing and returns False (the reader then gets the delta). It is
        offered only deltas that neither finish nor fail a completion (those end `batches()`); the deltas
        it writes count in the call's telemetry as the reader's do. Call it before `batches()` runs."""
        on_delta = self.call.on_delta

        def sink(delta: CompletionDelta) -> bool:
            if delta.finish_reason is not None or not write(delta):
                return False
            on_delta(delta)
            return True
        self._collector.sink = sink

    def abort(self) -> None:
        """End the unfinished completions now (an abort asked for by the client, vLLM's Control.Abort):
        they stop in the engine, and `batches()` hands out one final delta for each, finish_reason
        "abort", with its usage so far. A no-op before `start()` or once the request ended."""
        request = self._request
        if request is None or self._closed:
            return
        ended = [(c.index, c.num_tokens, c.num_cached) for c in request.unfinished.values()]
        self._dispatcher.abort(request)
        prepared = request.prepared
        for index, generated, cached in ended:
            self._collector.put(CompletionDelta(
                request_id=prepared.request_id, index=index, text="", token_ids=[], finish_reason="abort",
                usage=Usage(len(prepared.prompt_token_ids), generated, cached)))

    def close(self) -> None:
        """Abort what is unfinished in the engine and give the slots back (once; later calls no-op)."""
        if self._closed:
            return
        self._closed = True
        self._collector.sink = None
        self._collector.release()
        if self._request is not None:
            self._dispatcher.abort(self._request)  # a no-op once the request is done
        self._admission.give_back(self.slots, self._preparing)
