"""The owner of every request in flight: sends it to an engine, turns what comes back into its deltas.

vLLM's `AsyncLLM` owns the output processor and the engine-core client and runs the loop between them;
the `Dispatcher` is that loop here. A request from `submit` to its end has exactly one owner, this
dispatcher, which knows its state in the output processor (`RequestState`: which completions still run,
where their deltas wait) and the engine it was sent to. The engine client (engines/client.py) is transport
and routing only: it hands the dispatcher each engine stream's messages (`on_outputs`) and each stream
that breaks (`on_stream_down`).

Invariants:
- Every request handed out by `submit` ends exactly once: each completion's finished delta, or one
  `ServiceError` in its collector (UNAVAILABLE when its engine's stream broke, or what `fail_all` says).
  Once it ends it leaves `_engine_of` and its connection's `requests`.
- All n completions of one request go to the same engine (they share the prompt's KV blocks).
- A stop string that matches in the output processor aborts that completion in its engine at once.
- The outputs of several engine messages processed together are grouped by request (a request's outputs
  in engine order, requests in the order they first appear), so a request with outputs of several steps
  gets one merged delta and its reader sends them in one wire message.
- A large engine step is processed in slices of about `OUTPUT_SLICE` outputs (a request's never split)
  with the event loop free between them, so a step of hundreds of requests never holds it for all of
  them at once (the streams whose deltas are ready get written meanwhile).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence

from tandem.engine.v1 import engine_core_pb2 as epb

from frontend_svc.delta_collector import DeltaCollector
from frontend_svc.engines.client import EngineClient, EngineConnection
from frontend_svc.output_processor import OutputProcessor, ProcessedOutputs, RequestState
from frontend_svc.processor import PreparedRequest
from frontend_svc.service_error import UNAVAILABLE, ServiceError
from shared_runtime.contract import EngineCoreRequest
from shared_runtime.to_pb import abort_to_pb, add_to_pb

OUTPUT_SLICE = 32  # engine outputs processed between two turns of the event loop (`on_outputs`)

Keyed = tuple[str, epb.EngineCoreOutput]


class Dispatcher:
    """Requests in flight: submitted to an engine, their outputs processed, their ends made exactly once."""

    def __init__(self, engines: EngineClient, output_processor: OutputProcessor, *,
                 on_processed: Callable[[ProcessedOutputs], None] | None = None) -> None:
        """`on_processed` sees what the output processor handed out for each slice (telemetry). The
        dispatcher becomes `engines`' listener."""
        self.engines = engines
        self.output_processor = output_processor
        self._on_processed = on_processed
        self._engine_of: dict[RequestState, EngineConnection] = {}
        engines.listener = self

    def submit(self, prepared: PreparedRequest, engine_requests: Sequence[EngineCoreRequest],
               collector: DeltaCollector) -> RequestState:
        """Send the request's n engine requests to one ready engine (EngineUnavailable if none). Its
        deltas, or one ServiceError, arrive in `collector`."""
        connection = self.engines.choose(prepared.prompt_token_ids)
        messages = [add_to_pb(request) for request in engine_requests]  # may raise: before any state
        request = self.output_processor.add_request(prepared, collector)
        self._engine_of[request] = connection
        collector.gate = connection.gate
        connection.requests.add(request)
        connection.note_sent(len(messages))
        for message in messages:
            connection.send(message)
        return request

    def engine_of(self, request: RequestState) -> EngineConnection | None:
        """The engine a request in flight was sent to (None once it ended)."""
        return self._engine_of.get(request)

    def abort(self, request: RequestState) -> None:
        """Stop a request's unfinished completions, here and in its engine (a no-op once it ended)."""
        connection = self._engine_of.get(request)
        engine_ids = self._forget(request)
        if engine_ids and connection is not None:
            connection.send(abort_to_pb(engine_ids))

    def fail_all(self, code: int, message: str, reason: str) -> None:
        """End every request in flight with a ServiceError and abort it in its engine (a drain's end)."""
        for request in list(self._engine_of):
            self.abort(request)
            request.fail(ServiceError(code, message, reason))

    @property
    def num_in_flight(self) -> int:
        return len(self._engine_of)

    # ---- what the engine client hands over -----------------------------------------------------------
    async def on_outputs(self, connection: EngineConnection, *messages: epb.EngineCoreOutputs) -> None:
        """Consecutive engine messages of one stream: deltas to their collectors, stop-string aborts out,
        in slices with the event loop free between them (module docstring)."""
        process, first = self.output_processor.process_keyed, True
        for outputs in _slices(messages):
            if not first:
                await asyncio.sleep(0)
            first = False
            self._deliver(connection, process(outputs))

    def on_stream_down(self, connection: EngineConnection, message: str) -> None:
        """The stream broke: every request on it ends with UNAVAILABLE (the engine aborted them)."""
        for request in [r for r, engine in self._engine_of.items() if engine is connection]:
            self._forget(request)
            request.fail(ServiceError(UNAVAILABLE, message, "ENGINE_UNAVAILABLE"))

    def _deliver(self, connection: EngineConnection, processed: ProcessedOutputs) -> None:
        """A processed slice: telemetry, stop-string aborts to the engine, finished requests released."""
        if self._on_processed is not None:
            self._on_processed(processed)
        if processed.reqs_to_abort:
            connection.send(abort_to_pb(processed.reqs_to_abort))
        for request in processed.finished:
            self._release(request)

    # ---- bookkeeping ---------------------------------------------------------------------------------
    def _forget(self, request: RequestState) -> list[str]:
        """Finish a request's open completions in the output processor and release it; return the
        engine ids that were still running."""
        engine_ids = self.output_processor.abort_request(request)
        self._release(request)
        return engine_ids

    def _release(self, request: RequestState) -> None:
        """A request that ended leaves its engine (which closes if it was retired and is now idle)."""
        connection = self._engine_of.pop(request, None)
        if connection is not None:
            self.engines.release(connection, request)


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
