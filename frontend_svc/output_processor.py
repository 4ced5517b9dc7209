"""The output processor: engine outputs (token ids) -> per-completion text deltas.

It consumes one shape: the `tandem.engine.v1.EngineCoreOutputs` protobuf message, as it arrives from an
engine (the offline API converts its in-process step with shared_runtime/to_pb.py; why protobuf and not
the contract structs: shared_runtime/contract.py). For each live engine request it detokenizes
incrementally, checks stop strings and reports finishes. Invariants:
- Each completion gets exactly one finished delta (its last); afterwards its engine id is forgotten and
  any later engine output for it (e.g. the acknowledgement of an abort) is ignored.
- A stop-string match finishes the completion here at once and puts its engine id in `reqs_to_abort`
  (unless the engine finished it in the same step); the caller must abort it in the engine.
- When the engine stops on a stop token (EOS or a stop id), that token's text is left out of the
  output unless `include_stop_str_in_output` (as vLLM V1 does); a stop id is reported as `stop_reason`,
  an EOS id (one of the model's, not asked for in `stop_token_ids`) as None, as vLLM reports it.
- A completion that ends inside a multi-byte character leaves the unfinished character out of its text
  (vLLM's detokenizer never emits it either: no trailing U+FFFD on a length cut).
- A logprob token whose own decode ends in U+FFFD (a piece of a character) gets vLLM's text: "" until
  the token that completes the character, which gets the whole character (`partial_token_text`).
- A request is forgotten once all n completions finished. Its `RequestState` (below) is the one record of
  which completions are still running; this processor only indexes them by engine id.
- A request added with a `DeltaCollector` gets its deltas there (merged for a slow reader); the others'
  deltas are returned in `ProcessedOutputs.deltas` (the offline API folds them itself).
- Stream interval (vLLM's): a request with a collector streams each completion in deltas of at least
  `interval` tokens, the larger of the server's `stream_interval` and the request's
  `params.stream_interval`. A completion's first delta and its last (finished) one go out at once; any
  other waits in `Completion.held`, merged with the next, until >= interval tokens accumulated since
  the last delta sent. Merged deltas concatenate to the same output as interval 1. What is held when a
  request is aborted or fails (its engine lost) is dropped with it.
- With `hand_back`, an engine error output with code UNAVAILABLE (the engine drained, or failed, before
  the completion finished) does not end the completion: its engine id is put in
  `ProcessedOutputs.handed_back` and the completion stays unfinished, for the caller to continue on
  another engine (`rekey` then gives it the id it runs under there) or to fail. Any tokens such an output
  carries are dropped: the continuation regenerates them (the same tokens, from the same state).
- Each completion keeps the ids it generated (`Completion.generated`): a continuation starts from them.
- With `log_stats`, each step's engine-clock queue times (first SCHEDULED - QUEUED of a request) are
  handed out in `ProcessedOutputs.queue_times` for telemetry to record; nothing here records metrics.
- The common output (a completion past its first delta, without stop strings or logprobs, no finish, no
  error) takes a shortcut in `_process_one` that gives exactly the delta the general path gives; which
  logprob tokens are pieces of a character is read from the tokenizer's `TokenTexts.pieces()`.
Nothing here formats strings or logs per token.

Where text is decoded: only here, by each completion's incremental detokenizer (`Completion.detokenizer`),
in one of two moments. Normally when the engine output is processed. But a served completion at interval
1 on the common path whose previous delta is still unread in its `DeltaCollector` (its reader is behind)
does not decode each step: the step's ids join the unread delta (`Completion.undecoded`), and the text of
all of them is decoded in one tokenizer call (`Completion.settle`) just before the reader takes the delta
(the collector's `get` calls `settle`, or its `flush` before a sink writes it), when a later output needs the text in order (a finish, a stop
string, an error), or every `SETTLE_AT` ids for a reader that stays away. A step whose completion has
nothing unread is decoded at once, as before. Either way the concatenated text is the same; only the
number of tokenizer calls differs (BENCHMARKS.md, "the deferred decode").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.internal.containers import RepeatedCompositeFieldContainer
from tandem.engine.v1 import engine_core_pb2 as epb

from frontend_svc.delta_collector import DeltaCollector
from frontend_svc.outputs import CompletionDelta, CompletionError, TokenLogprob, Usage
from frontend_svc.pd_flow import kept_kv_params
from frontend_svc.processor import PreparedRequest
from frontend_svc.service_error import INTERNAL, ServiceError
from shared_runtime.detokenizer import IncrementalDetokenizer
from shared_runtime.stop import StopChecker
from shared_runtime.token_texts import REPLACEMENT, TokenTexts

# Indexed by the wire FinishReason number (0 = unspecified, 1 stop, 2 length, 3 abort, 4 error).
_FINISH_NAMES: tuple[str | None, ...] = (None, "stop", "length", "abort", "error")
_QUEUED, _SCHEDULED = epb.REQUEST_EVENT_TYPE_QUEUED, epb.REQUEST_EVENT_TYPE_SCHEDULED
_ERROR = epb.FINISH_REASON_ERROR
_UNAVAILABLE = 14  # the engine could not finish the request (it drained or failed): grpc.StatusCode.UNAVAILABLE


logger = logging.getLogger(__name__)


class RequestState:
    """One client request in flight: its prepared input, its unfinished completions and its outbox.

    A completion leaves `unfinished` exactly once, when it finishes or is aborted, so `num_unfinished`
    and `done` are derived from it (an engine connection's load reads it; a `Generation` reading the
    deltas ends when it has handed out one final delta per completion)."""

    __slots__ = ("collector", "prepared", "unfinished")

    def __init__(self, prepared: PreparedRequest, collector: DeltaCollector | None = None) -> None:
        self.prepared = prepared
        self.collector = collector  # None: deltas are returned by process_outputs (the offline API)
        self.unfinished: dict[str, Completion] = {}  # engine request id -> its running completion

    @property
    def num_unfinished(self) -> int:
        return len(self.unfinished)

    @property
    def done(self) -> bool:
        return not self.unfinished

    def fail(self, error: ServiceError) -> None:
        """End the request with `error` for its reader (a request without a collector has none)."""
        if self.collector is not None:
            self.collector.fail(error)


@dataclass
class ProcessedOutputs:
    deltas: list[CompletionDelta] = field(default_factory=list)  # of requests without a collector
    reqs_to_abort: list[str] = field(default_factory=list)  # engine ids finished by a stop string
    handed_back: list[str] = field(default_factory=list)  # engine ids the engine gave back (`hand_back`)
    finished: list[RequestState] = field(default_factory=list)  # requests whose last completion ended
    queue_times: list[float] = field(default_factory=list)  # engine-clock seconds, with log_stats only


class Completion:
    """Per engine request state: detokenizer, stop checker, counters."""

    __slots__ = ("collector", "continued", "detokenizer", "engine_id", "generated", "held", "index", "interval",
                 "logprob_context", "num_cached", "num_sent", "num_tokens", "pending", "plain", "request",
                 "request_id", "sent_first", "stop_checker", "undecoded")

    def __init__(self, request: RequestState, index: int, detokenizer: IncrementalDetokenizer,
                 interval: int = 1) -> None:
        params = request.prepared.params
        stops = params.stop
        self.request = request
        self.request_id = request.prepared.request_id  # the client's
        self.index = index
        self.engine_id = request.prepared.engine_request_ids[index]
        self.detokenizer = detokenizer
        self.stop_checker = StopChecker(stops, params.include_stop_str_in_output,
                                        request.prepared.stop_automaton) if stops else None
        self.num_tokens = 0
        self.generated: list[int] = []  # every id the engine(s) sampled for it, in order
        self.num_cached = 0
        self.continued = False  # runs on a second engine: usage keeps the first engine's cached count
        self.sent_first = False
        # The fast path's completions (`OutputProcessor._process_one`): past their first delta, with no
        # stop strings and no logprobs to look after.
        self.plain = False
        self.logprob_context: list[int] = []  # the last sampled ids (partial_token_text's context)
        self.interval = interval  # stream interval: > 1 holds deltas back (`due`)
        self.held: CompletionDelta | None = None  # output not yet due (stream interval)
        self.num_sent = 0  # num_tokens when the last delta went out
        # Decoding when the reader takes the output (a served request at interval 1): `pending` is the
        # delta of this completion last put in `collector` (unread while the collector still holds it),
        # whose text lacks that of the ids in `undecoded` (the steps that came while it was unread).
        self.collector = request.collector if interval == 1 else None
        self.pending: CompletionDelta | None = None
        self.undecoded: list[int] = []

    def settle(self) -> None:
        """Give the unread delta the text of its undecoded ids (before anything else is decoded or the
        reader takes it)."""
        if self.undecoded:
            assert self.pending is not None
            self.pending.text += self.detokenizer.add(self.undecoded)
            self.undecoded = []

    def due(self, delta: CompletionDelta) -> CompletionDelta | None:
        """With a stream interval: what to send now, `delta` after whatever was held (merged), when it
        is the first output, the last (finished) one, or >= interval tokens since the last sent; else
        None (it is held until then)."""
        held = self.held
        if held is not None:
            held.merge(delta)
            delta = held
        if delta.finish_reason is None and self.num_sent and self.num_tokens - self.num_sent < self.interval:
            self.held = delta
            return None
        self.held = None
        self.num_sent = self.num_tokens
        return delta


class OutputProcessor:
    """Turns engine outputs into `CompletionDelta`s for every request added with `add_request`."""

    def __init__(self, tokenizer: Any, log_stats: bool = False, stream_interval: int = 1,
                 hand_back: bool = False) -> None:
        """`tokenizer`: the frontend `Tokenizer` (its `.backend` is the `tokenizers.Tokenizer`);
        `log_stats`: hand out queue times in each `ProcessedOutputs`; `stream_interval`: the server's
        (vLLM's `--stream-interval`), the least a request with a collector streams in; `hand_back`:
        report UNAVAILABLE engine errors in `handed_back` instead of ending the completion."""
        self._stream_interval = stream_interval
        self._hand_back = hand_back
        self._backend = getattr(tokenizer, "backend", tokenizer)
        self._texts: TokenTexts = getattr(tokenizer, "token_texts", None) or TokenTexts(self._backend)
        self._log_stats = log_stats
        backend = self._backend
        self._decode: Callable[[list[int]], str] = lambda ids: backend.decode(ids, skip_special_tokens=False)
        self._completions: dict[str, Completion] = {}  # engine id -> unfinished completion (an index)
        self._pieces = self._texts.pieces()  # decoded once per tokenizer, here rather than under a request

    def add_request(self, prepared: PreparedRequest, collector: DeltaCollector | None = None) -> RequestState:
        """Start tracking a request's n completions; its deltas go to `collector` when given."""
        request = RequestState(prepared, collector)
        params = prepared.params
        primed = IncrementalDetokenizer(self._backend, prepared.prompt_token_ids, params.skip_special_tokens,
                                        self._texts)
        interval = max(self._stream_interval, params.stream_interval or 1) if collector is not None else 1
        for index, engine_id in enumerate(prepared.engine_request_ids):
            completion = Completion(request, index, primed if index == 0 else primed.copy(), interval)
            self._completions[engine_id] = request.unfinished[engine_id] = completion
        return request

    def owner(self, engine_id: str) -> RequestState | None:
        """The request whose unfinished completion runs as `engine_id`, if any."""
        completion = self._completions.get(engine_id)
        return completion.request if completion is not None else None

    def rekey(self, request: RequestState, engine_id: str, new_engine_id: str) -> Completion:
        """The unfinished completion `engine_id` of `request` runs as `new_engine_id` from now on (a
        continuation on another engine); later outputs for the old id are ignored."""
        completion = request.unfinished.pop(engine_id)
        del self._completions[engine_id]
        completion.engine_id = new_engine_id
        completion.continued = True
        self._completions[new_engine_id] = request.unfinished[new_engine_id] = completion
        return completion

    def abort_request(self, request: RequestState) -> list[str]:
        """Finish a request's unfinished completions here, without output; return their engine ids
        (for the caller to abort in the engine). Empty once the request is done."""
        engine_ids = list(request.unfinished)
        for completion in list(request.unfinished.values()):
            self._finish(completion)
        return engine_ids

    def process_outputs(self, engine_core_outputs: epb.EngineCoreOutputs) -> ProcessedOutputs:
        """Process one step's `EngineCoreOutputs`; outputs for unknown/finished ids are ignored."""
        return self.process(engine_core_outputs.outputs)

    def process(self, outputs: Iterable[epb.EngineCoreOutput]) -> ProcessedOutputs:
        """Process some of a step's outputs (a caller may split a large step into slices, in order)."""
        return self.process_keyed([(output.request_id, output) for output in outputs])

    def process_keyed(self, outputs: Iterable[tuple[str, epb.EngineCoreOutput]]) -> ProcessedOutputs:
        """`process` for outputs that come with their request ids (read once, by the engine client)."""
        result = ProcessedOutputs()
        log_stats, completions, deltas = self._log_stats, self._completions, result.deltas
        for request_id, output in outputs:
            completion = completions.get(request_id)
            if completion is None:
                continue
            if log_stats and output.events:
                _note_queue_time(output.events, result.queue_times)
            if output.finish_reason == _ERROR and self._hand_back and output.error.code == _UNAVAILABLE:
                result.handed_back.append(request_id)
                continue
            try:
                delta = self._process_one(completion, output, result.reqs_to_abort)
            except Exception:  # a fault in one completion's processing must not fail the others
                logger.exception("processing output of %s failed; ending that completion", request_id)
                delta = self._fail(completion, result.reqs_to_abort)
            if delta is None:
                continue
            if completion.interval > 1:
                delta = completion.due(delta)
                if delta is None:
                    continue
            request = completion.request
            collector = request.collector
            if collector is not None:
                collector.put(delta)
            else:
                deltas.append(delta)
            if delta.finish_reason is not None and not request.unfinished:  # only a finished delta ends it
                result.finished.append(request)
        return result

    def _fail(self, c: Completion, to_abort: list[str]) -> CompletionDelta:
        """End a completion with an INTERNAL error and have the engine drop it."""
        delta = CompletionDelta(c.request_id, c.index, "", [], c.engine_id)
        delta.finish_reason, delta.error = "error", CompletionError(INTERNAL, "output processing failed")
        delta.usage = Usage(len(c.request.prepared.prompt_token_ids), c.num_tokens, c.num_cached)
        to_abort.append(c.engine_id)
        self._finish(c)
        return delta

    def _process_one(self, c: Completion, output: epb.EngineCoreOutput,
                     to_abort: list[str]) -> CompletionDelta | None:
        new_ids = output.new_token_ids[:]  # a list
        c.num_tokens += len(new_ids)
        c.generated += new_ids
        cached = output.num_cached_tokens
        if cached and not c.continued:
            c.num_cached = cached
        if c.plain and not output.finish_reason and not output.HasField("error"):
            # The common output, what the general path below makes of it: its tokens' text, nothing else.
            if not new_ids:
                return None
            collector = c.collector
            if collector is not None:
                pending = c.pending
                if pending is not None and collector.unread(c.index) is pending:
                    # The reader has not taken this completion's previous output: these ids join it, to be
                    # decoded in one tokenizer call when it does (`settle`), not one call per step.
                    pending.token_ids.extend(new_ids)
                    undecoded = c.undecoded
                    if not undecoded:
                        collector.defer(c)
                    undecoded.extend(new_ids)
                    if len(undecoded) >= SETTLE_AT:  # a reader that stays away: decode in bounded pieces
                        c.settle()
                    return None
                # Decoded now, with the other outputs of this message (a reader that keeps up takes it as is).
                delta = CompletionDelta(c.request_id, c.index, c.detokenizer.add(new_ids), new_ids, c.engine_id)
                c.pending = collector.put(delta)
                return None
            text = c.detokenizer.add(new_ids)
            held = c.held
            if held is None:
                return CompletionDelta(c.request_id, c.index, text, new_ids, c.engine_id)
            # Held back by the stream interval: what `due` would merge into it, without a delta to merge.
            c.held = None
            held.text += text
            held.token_ids.extend(new_ids)
            return held
        if c.undecoded:  # the ids before these are decoded first
            c.settle()
        params = c.request.prepared.params
        finish = _finish_name(output.finish_reason)
        error = None
        if output.HasField("error"):
            finish, error = "error", CompletionError(output.error.code, output.error.message)
        stop_reason: str | int | None = None
        text_ids = new_ids
        if finish == "stop" and output.HasField("stop_token_id"):
            stop_id = output.stop_token_id
            if not params.include_stop_str_in_output and new_ids and new_ids[-1] == stop_id:
                text_ids = new_ids[:-1]
            eos = stop_id in c.request.prepared.eos_token_ids and stop_id not in params.stop_token_ids
            stop_reason = None if eos else stop_id
        text = c.detokenizer.add(text_ids) if text_ids else ""
        if c.stop_checker is not None:
            text, matched = c.stop_checker.feed(text, c.num_tokens > params.min_tokens)
            if matched is not None and error is None:
                if finish is None:
                    to_abort.append(c.engine_id)
                finish, stop_reason = "stop", matched
            elif finish is not None:
                text += c.stop_checker.flush()
        prompt_logprobs = None
        if not c.sent_first and output.prompt_logprobs:
            prompt_logprobs = self._logprobs(output.prompt_logprobs, [])
        if not (text or new_ids or finish or prompt_logprobs):
            return None
        if not c.sent_first:
            c.sent_first = True
            c.plain = c.stop_checker is None and params.logprobs is None
        delta = CompletionDelta(c.request_id, c.index, text, new_ids, c.engine_id)
        if params.logprobs is not None:
            delta.logprobs = self._logprobs(output.new_logprobs, c.logprob_context)
        delta.prompt_logprobs = prompt_logprobs
        if finish is not None:
            delta.finish_reason, delta.stop_reason, delta.error = finish, stop_reason, error
            delta.usage = Usage(len(c.request.prepared.prompt_token_ids), c.num_tokens, c.num_cached)
            delta.kv_transfer_params = kept_kv_params(output)
            self._finish(c)
        return delta

    def _logprobs(self, entries: Sequence[epb.TokenLogprobs], context: list[int]) -> list[TokenLogprob]:
        """Logprob entries with token texts, pieces of a character as vLLM writes them; `context` (the
        last sampled or prompt ids before them) is updated."""
        texts, pieces = self._texts, self._pieces
        kept = texts.kept
        out = []
        for e in entries:
            token_id = e.token_id
            top_ids = e.top_token_ids[:]
            text = kept.get(token_id)
            if text is None:
                text = texts.text(token_id)
            entry = TokenLogprob(token_id, e.logprob, e.rank, list(zip(top_ids, e.top_logprobs)), text)
            if token_id in pieces:
                entry.text = partial_token_text(self._decode, token_id, context)
            if not pieces.isdisjoint(top_ids):
                entry.top_texts = [partial_token_text(self._decode, tid, context) if tid in pieces
                                   else texts.text(tid) for tid in top_ids]
            out.append(entry)
            context.append(token_id)
            if len(context) > _CONTEXT:
                del context[0]
        return out

    def _finish(self, c: Completion) -> None:
        """Forget a finished completion: it leaves the index and its request's unfinished set."""
        del self._completions[c.engine_id]
        del c.request.unfinished[c.engine_id]


_CONTEXT = 4  # ids: enough for any UTF-8 character
SETTLE_AT = 64  # undecoded ids of one completion decoded at once at most (a stalled reader's deltas)


def partial_token_text(decode: Callable[[list[int]], str], token_id: int, context: Sequence[int]) -> str:
    """vLLM's text for a logprob token whose own decode ends in U+FFFD (a byte of a character): with the
    last 1..4 sampled ids as context, the first decode of context + token that ends the character gives
    the text past the context's clean prefix (the context ids that were themselves pieces count for
    this token); "" while the character is unfinished."""
    for size in range(1, min(len(context), _CONTEXT) + 1):
        ctx = list(context[-size:])
        full = decode([*ctx, token_id])
        if full.endswith(REPLACEMENT):
            continue
        clean = len(ctx)
        while clean > 0 and decode([ctx[clean - 1]]).endswith(REPLACEMENT):
            clean -= 1
        prefix = decode(ctx[:clean]) if clean else ""
        if full.startswith(prefix):
            return full[len(prefix):]
        common = 0
        for a, b in zip(prefix, full):
            if a != b:
                break
            common += 1
        return full[common:]
    return ""


def _finish_name(reason: int) -> str | None:
    return _FINISH_NAMES[reason] if 0 <= reason < len(_FINISH_NAMES) else "error"


def _note_queue_time(events: RepeatedCompositeFieldContainer[epb.RequestEvent], into: list[float]) -> None:
    """Append first SCHEDULED - QUEUED (engine clock) when this output carries both."""
    queued = scheduled = None
    for event in events:
        if event.type == _QUEUED:
            queued = event.timestamp
        elif event.type == _SCHEDULED and scheduled is None:
            scheduled = event.timestamp
    if queued is not None and scheduled is not None:
        into.append(max(0.0, scheduled - queued))

