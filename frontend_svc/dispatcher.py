"""The owner of every request in flight: sends it to an engine, turns what comes back into its deltas, and
moves it to another engine when its own dies or drains.

vLLM's `AsyncLLM` owns the output processor and the engine-core client and runs the loop between them;
the `Dispatcher` is that loop here. A request from `submit` to its end has exactly one owner, this
dispatcher, which knows its state in the output processor (`RequestState`: which completions still run,
what each generated, where their deltas wait) and the engine it runs on. The engine client
(engines/client.py) is transport and routing only: it hands the dispatcher each engine stream's messages
(`on_outputs`) and each stream that breaks (`on_stream_down`).

Migration. When a request's engine stream breaks (the engine died or was lost) or the engine hands the
request back (an UNAVAILABLE error output: it drained, or failed, before the request finished), the
request continues on another ready engine (after a hand-back, never the engine that gave it back): each unfinished completion is re-sent as a continuation -
the prompt plus `output_token_ids`, the tokens it generated so far, which the engine counts as output
(max_tokens, min_tokens, penalties, the seeded random stream, a grammar all continue after them) - under
a new engine id. The client's stream goes on from where it was: the output processor's state (the
detokenizer, held stop-string text, logprob context, usage counts) is kept; tokens the lost engine
sampled but never delivered are sampled again, the same ones. A request moves at most
`MigrationPolicy.max_migrations` times and waits at most `timeout_s` for a ready engine; otherwise it ends
with UNAVAILABLE (the client may retry), as every request did before migration existed.

Prefill/decode disaggregation (`--routing pd`, pd_flow.py): a request starts on a prefill engine for
its first token; the prefill's last output (LENGTH, with the kept blocks' kv_transfer_params) reaches the
output processor as an ordinary token, and once every completion's has come the request continues on a
decode engine - the same continuation as a migration (`<first id>.d`), pulling the prompt's K/V. With no
decode engine ready by then it continues on the prefill engine itself (its prefix cache holds the prompt),
and the kept blocks are released by an abort.

Invariants:
- Every request handed out by `submit` ends exactly once: each completion's finished delta, or one
  `ServiceError` in its collector (UNAVAILABLE when it could not be continued, or what `fail_all` says).
  Once it ends it leaves every table here and its connection's `requests`.
- All n completions of one request run on the same engine (they share the prompt's KV blocks), and move
  together.
- Engine request ids are unique: a continuation runs under `<first id>.m<k>`, so outputs still in flight
  from the engine it left (after a hand-back) are ignored.
- A stop string that matches in the output processor aborts that completion in its engine at once.
- The outputs of several engine messages processed together are grouped by request (a request's outputs
  in engine order, requests in the order they first appear), so a request with outputs of several steps
  gets one merged delta and its reader sends them in one wire message.
- A stream whose reader waits for output with a sink (delta_collector.py) gets its deltas of a slice
  written, merged per completion, once the slice is processed (`SinkBatch.flush`), as a woken reader would.
- A large engine step is processed in slices of about `OUTPUT_SLICE` outputs (a request's never split)
  with the event loop free between them, so a step of hundreds of requests never holds it for all of
  them at once (the streams whose deltas are ready get written meanwhile).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import msgspec
from tandem.engine.v1 import engine_core_pb2 as epb

from frontend_svc.delta_collector import DeltaCollector, SinkBatch
from frontend_svc.engines.client import EngineClient, EngineConnection, EngineUnavailable
from frontend_svc.output_processor import OutputProcessor, ProcessedOutputs, RequestState
from frontend_svc.pd_flow import (
    DECODE,
    PREFILL,
    decode_request,
    kept_blocks,
    prefill_request,
    wants_disaggregation,
)
from frontend_svc.processor import PreparedRequest
from frontend_svc.service_error import UNAVAILABLE, ServiceError
from shared_runtime.contract import EngineCoreRequest, KvTransferParams
from shared_runtime.to_pb import abort_to_pb, add_to_pb

logger = logging.getLogger(__name__)

OUTPUT_SLICE = 32  # engine outputs processed between two turns of the event loop (`on_outputs`)
ENGINE_LOST = "engine_lost"  # a migration's reason: the engine's stream broke
HANDED_BACK = "handed_back"  # the engine gave the request back (it drained or failed)

Keyed = tuple[str, epb.EngineCoreOutput]


@dataclass(frozen=True)
class MigrationPolicy:
    """How far a request may follow its engines: `max_migrations` moves (0: none, every request ends with
    its engine) and `timeout_s` to wait for a ready engine to continue on."""

    max_migrations: int = 3
    timeout_s: float = 10.0


@dataclass(frozen=True)
class Migration:
    """One move of one request (or a move that could not be made: `to_address` None)."""

    request_id: str  # the client's
    reason: str  # ENGINE_LOST or HANDED_BACK
    number: int  # 1 for its first move
    from_address: str
    to_address: str | None


OnMigration = Callable[[Migration], None]


class Dispatcher:
    """Requests in flight: submitted to an engine, their outputs processed, moved when their engine goes
    away, their ends made exactly once."""

    def __init__(self, engines: EngineClient, output_processor: OutputProcessor, *,
                 on_processed: Callable[[ProcessedOutputs], None] | None = None,
                 migration: MigrationPolicy | None = None, on_migration: OnMigration | None = None) -> None:
        """`on_processed` sees what the output processor handed out for each slice (telemetry);
        `on_migration` every move (metrics, logs). The dispatcher becomes `engines`' listener. With
        migration on, the output processor must hand back UNAVAILABLE errors (`hand_back=True`)."""
        self.engines = engines
        self.output_processor = output_processor
        self.migration = migration or MigrationPolicy(max_migrations=0)
        self._on_processed = on_processed
        self._on_migration = on_migration
        self._engine_of: dict[RequestState, EngineConnection] = {}
        self._sent: dict[RequestState, dict[str, EngineCoreRequest]] = {}  # engine id -> what runs there
        self._moves: dict[RequestState, int] = {}  # how many times it moved
        self._moving: dict[RequestState, asyncio.Task[None]] = {}  # waiting for an engine to continue on
        self._listeners: dict[RequestState, OnMigration] = {}
        # P/D: requests on their prefill engine, and the kept blocks of each completion as they come.
        self._prefilling: dict[RequestState, dict[str, KvTransferParams | None]] = {}
        self._prefill_of: dict[str, RequestState] = {}  # engine id of a prefill -> its request
        self._sinks = SinkBatch()  # collectors whose sinks write once the slice being processed ends
        engines.listener = self

    def submit(self, prepared: PreparedRequest, engine_requests: Sequence[EngineCoreRequest],
               collector: DeltaCollector, on_migration: OnMigration | None = None) -> RequestState:
        """Send the request's n engine requests to one ready engine (EngineUnavailable if none). Its
        deltas, or one ServiceError, arrive in `collector`; `on_migration` hears of each of its moves."""
        prefill_on = self._prefill_engine(prepared, engine_requests)
        connection = prefill_on or self.engines.choose(prepared.prompt_token_ids, lora_name=prepared.lora_name)
        to_send = [prefill_request(r) for r in engine_requests] if prefill_on else engine_requests
        messages = [add_to_pb(request) for request in to_send]  # may raise: before any state
        request = self.output_processor.add_request(prepared, collector)
        collector.batch = self._sinks
        self._sent[request] = {r.request_id: r for r in engine_requests}
        if prefill_on is not None:
            self._prefilling[request] = {r.request_id: None for r in engine_requests}
            self._prefill_of.update((r.request_id, request) for r in engine_requests)
        if on_migration is not None:
            self._listeners[request] = on_migration
        self._attach(request, connection, messages)
        return request

    def engine_of(self, request: RequestState) -> EngineConnection | None:
        """The engine a request in flight runs on (None once it ended, or while it moves)."""
        return self._engine_of.get(request)

    def abort(self, request: RequestState) -> None:
        """Stop a request's unfinished completions, here and in its engine (a no-op once it ended)."""
        connection = self._engine_of.get(request)
        engine_ids = self._forget(request)
        if engine_ids and connection is not None:
            connection.send(abort_to_pb(engine_ids))

    def fail_all(self, code: int, message: str, reason: str) -> None:
        """End every request in flight with a ServiceError and abort it in its engine (a drain's end)."""
        for request in [*self._engine_of, *self._moving]:
            self.abort(request)
            request.fail(ServiceError(code, message, reason))

    @property
    def num_in_flight(self) -> int:
        return len(self._sent)

    # ---- what the engine client hands over -----------------------------------------------------------
    async def on_outputs(self, connection: EngineConnection, *messages: epb.EngineCoreOutputs) -> None:
        """Consecutive engine messages of one stream: deltas to their collectors, stop-string aborts out,
        in slices with the event loop free between them (module docstring)."""
        process, first = self.output_processor.process_keyed, True
        prefilled = self._note_prefills(messages) if self._prefill_of else ()
        for outputs in _slices(messages):
            if not first:
                await asyncio.sleep(0)
            first = False
            processed = process(outputs)
            self._sinks.flush()
            self._deliver(connection, processed)
        for request in prefilled:
            self._after_prefill(request, connection)

    def on_stream_down(self, connection: EngineConnection, message: str) -> None:
        """The stream broke: the engine aborted its requests; each moves to another engine, or ends with
        UNAVAILABLE when it cannot."""
        for request in [r for r, engine in self._engine_of.items() if engine is connection]:
            self._move(request, connection, ENGINE_LOST, message)

    def _deliver(self, connection: EngineConnection, processed: ProcessedOutputs) -> None:
        """A processed slice: telemetry, stop-string aborts to the engine, requests the engine handed back
        moved, finished requests released."""
        if self._on_processed is not None:
            self._on_processed(processed)
        if processed.reqs_to_abort:
            connection.send(abort_to_pb(processed.reqs_to_abort))
        if processed.handed_back:
            self._take_back(connection, processed.handed_back)
        for request in processed.finished:
            self._release(request)

    # ---- prefill/decode disaggregation ---------------------------------------------------------------
    def _prefill_engine(self, prepared: PreparedRequest, engine_requests: Sequence[EngineCoreRequest]
                        ) -> EngineConnection | None:
        """The prefill engine for a request under `--routing pd` when P/D applies (pd_flow), else None."""
        if self.engines.router.policy != "pd" or not self.engines.ready_in(DECODE):
            return None
        if any(r.kv_transfer_params is not None for r in engine_requests):
            return None  # the client drives P/D itself (an OpenAI body's kv_transfer_params)
        try:
            connection = self.engines.choose(prepared.prompt_token_ids, pool=PREFILL, lora_name=prepared.lora_name)
        except EngineUnavailable:
            return None
        info = connection.info
        if info is None or not wants_disaggregation(engine_requests, int(info.max_model_len)):
            return None
        return connection

    def _note_prefills(self, messages: Sequence[epb.EngineCoreOutputs]) -> list[RequestState]:
        """Record the kept blocks of prefills that ended, and turn their LENGTH finish into an ordinary
        token for the output processor; the requests whose every completion is now prefilled."""
        ready: list[RequestState] = []
        for message in messages:
            for output in message.outputs:
                request = self._prefill_of.get(output.request_id)
                kept = kept_blocks(output) if request is not None else None
                if request is None or kept is None:
                    continue
                output.finish_reason = epb.FINISH_REASON_UNSPECIFIED
                slots = self._prefilling[request]
                slots[output.request_id] = kept
                if all(v is not None for v in slots.values()) and request not in ready:
                    ready.append(request)
        return ready

    def _end_prefill(self, request: RequestState) -> dict[str, KvTransferParams | None]:
        slots = self._prefilling.pop(request, {})
        for engine_id in slots:
            self._prefill_of.pop(engine_id, None)
        return slots

    def _after_prefill(self, request: RequestState, prefill: EngineConnection) -> None:
        """Continue the prefilled request's unfinished completions on a decode engine, pulling the kept
        blocks (or, with none ready, on the prefill engine itself, releasing them)."""
        kept = self._end_prefill(request)
        if not kept or self._engine_of.get(request) is not prefill:
            return  # ended, or moved away, meanwhile
        # A completion that ended on its first token (a stop string) was aborted there, which released its
        # kept blocks; one that ended in the engine (EOS, an error) kept none.
        if request.done:
            return
        try:
            target = self.engines.choose(request.prepared.prompt_token_ids, pool=DECODE,
                                         lora_name=request.prepared.lora_name)
        except EngineUnavailable:
            target = prefill
        sent = self._sent[request]
        continued: dict[str, EngineCoreRequest] = {}
        for engine_id, completion in list(request.unfinished.items()):
            new_id = f"{request.prepared.engine_request_ids[completion.index]}.d"
            blocks = kept.get(engine_id)
            if target is prefill or blocks is None:
                continued[new_id] = msgspec.structs.replace(
                    sent[engine_id], request_id=new_id, output_token_ids=list(completion.generated))
            else:
                continued[new_id] = decode_request(sent[engine_id], new_id, completion.generated, blocks,
                                                   drop_prompt_logprobs=completion.sent_first)
            self.output_processor.rekey(request, engine_id, new_id)
        if target is prefill:
            prefill.send(abort_to_pb(list(kept)))
        self._detach(request)
        self._sent[request] = continued
        self._attach(request, target, [add_to_pb(r) for r in continued.values()])

    # ---- migration -----------------------------------------------------------------------------------
    def _take_back(self, connection: EngineConnection, engine_ids: list[str]) -> None:
        """The engine gave these completions back: their requests move, all completions together (those
        it still runs are aborted there)."""
        handed = set(engine_ids)
        for request in {self.output_processor.owner(i) for i in engine_ids} - {None}:
            assert request is not None
            if self._engine_of.get(request) is not connection:
                continue  # already moving, or ended
            still_there = [i for i in request.unfinished if i not in handed]
            if still_there:
                connection.send(abort_to_pb(still_there))
            self._move(request, connection, HANDED_BACK,
                       f"engine {connection.address} gave the request back before it finished")

    def _move(self, request: RequestState, connection: EngineConnection, reason: str, message: str) -> None:
        """Continue `request` on another engine, or end it with UNAVAILABLE when it may not move again."""
        self._end_prefill(request)  # a request moved off its prefill engine goes on as a plain one
        self._detach(request)
        moves = self._moves.get(request, 0)
        if moves >= self.migration.max_migrations or request.done:
            why = "" if not self.migration.max_migrations else f" (moved {moves} times already)"
            self._report(request, reason, moves + 1, connection.address, None)
            self._fail(request, f"{message}{why}; retry the request")
            return
        self._moves[request] = moves + 1
        task = asyncio.get_running_loop().create_task(
            self._continue(request, connection, reason, message), name=f"continue {request.prepared.request_id}")
        self._moving[request] = task

    async def _continue(self, request: RequestState, left: EngineConnection, reason: str, message: str) -> None:
        """Wait (at most the policy's timeout) for a ready engine and re-send the request's unfinished
        completions there as continuations."""
        timeout = self.migration.timeout_s
        # An engine that gave the request back will not take it again (it drains, or fails requests while it
        # stays up); a lost engine may come back, restarted at the same address, and take it.
        avoid = left if reason == HANDED_BACK else None
        connection = None
        while connection is None:
            try:
                connection = self.engines.choose(request.prepared.prompt_token_ids, avoid,
                                                 lora_name=request.prepared.lora_name)
            except EngineUnavailable:
                if not await self.engines.wait_for_ready_engine(timeout, avoid):
                    break
        del self._moving[request]
        number = self._moves[request]
        if connection is None:
            self._report(request, reason, number, left.address, None)
            self._fail(request, f"{message}, and no engine became ready within {timeout:g} s to continue it; "
                                "retry the request")
            return
        sent = self._sent[request]
        continued: dict[str, EngineCoreRequest] = {}
        for engine_id, completion in list(request.unfinished.items()):
            root = request.prepared.engine_request_ids[completion.index]
            new_id = f"{root}.m{number}"
            original = sent[engine_id]
            params = original.sampling_params
            if completion.sent_first and params.prompt_logprobs is not None:  # the client has them already
                params = msgspec.structs.replace(params, prompt_logprobs=None)
            continued[new_id] = msgspec.structs.replace(
                original, request_id=new_id, sampling_params=params, output_token_ids=list(completion.generated),
                kv_transfer_params=None)  # a moved decode recomputes: its producer's blocks are pulled or gone
            self.output_processor.rekey(request, engine_id, new_id)
        self._sent[request] = continued
        self._attach(request, connection, [add_to_pb(r) for r in continued.values()])
        self._report(request, reason, number, left.address, connection.address)
        logger.info("request %s moved from engine %s to %s (%s, move %d)", request.prepared.request_id,
                    left.address, connection.address, reason, number)

    def _report(self, request: RequestState, reason: str, number: int, from_address: str,
                to_address: str | None) -> None:
        migration = Migration(request.prepared.request_id, reason, number, from_address, to_address)
        if self._on_migration is not None:
            self._on_migration(migration)
        listener = self._listeners.get(request)
        if listener is not None:
            listener(migration)

    def _fail(self, request: RequestState, message: str) -> None:
        self._forget(request)
        request.fail(ServiceError(UNAVAILABLE, message, "ENGINE_UNAVAILABLE"))

    # ---- bookkeeping ---------------------------------------------------------------------------------
    def _attach(self, request: RequestState, connection: EngineConnection, messages: list[epb.EngineCoreInput]) -> None:
        """`request` runs on `connection` from now on: its adds go out, its reader paces that stream."""
        self._engine_of[request] = connection
        if request.collector is not None:
            request.collector.gate = connection.gate
        connection.requests.add(request)
        connection.note_sent(len(messages))
        for message in messages:
            connection.send(message)

    def _detach(self, request: RequestState) -> None:
        """`request` no longer runs on its engine (which closes if it was retired and is now idle)."""
        connection = self._engine_of.pop(request, None)
        if connection is not None:
            self.engines.release(connection, request)

    def _forget(self, request: RequestState) -> list[str]:
        """Finish a request's open completions in the output processor and release it; return the
        engine ids that were still running."""
        engine_ids = self.output_processor.abort_request(request)
        self._release(request)
        return engine_ids

    def _release(self, request: RequestState) -> None:
        """A request that ended leaves every table (a move in progress is cancelled)."""
        self._end_prefill(request)
        self._detach(request)
        self._sent.pop(request, None)
        self._moves.pop(request, None)
        self._listeners.pop(request, None)
        task = self._moving.pop(request, None)
        if task is not None:
            task.cancel()


def _slices(messages: Sequence[epb.EngineCoreOutputs]) -> Iterator[list[Keyed]]:
    """The messages' outputs with their request ids (each read once), each request's next to each other
    in engine order (requests in the order they first appear; one engine message may hold several steps
    too, engine_svc/api/output_packing.py), in slices of about `OUTPUT_SLICE` outputs that never split a
    request's outputs. Outputs of distinct requests (the usual message) are already in that order: sliced
    as they come."""
    keyed = [(output.request_id, output) for message in messages for output in message.outputs]
    if len(dict(keyed)) == len(keyed):
        for start in range(0, max(len(keyed), 1), OUTPUT_SLICE):
            yield keyed[start:start + OUTPUT_SLICE]
        return
    groups: dict[str, list[Keyed]] = {}
    for pair in keyed:
        group = groups.get(pair[0])
        if group is None:
            groups[pair[0]] = [pair]
        else:
            group.append(pair)
    chunk: list[Keyed] = []
    for group in groups.values():
        if len(chunk) + len(group) > OUTPUT_SLICE and chunk:
            yield chunk
            chunk = []
        chunk.extend(group)
    yield chunk
