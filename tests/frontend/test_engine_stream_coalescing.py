"""Coalescing when the frontend is behind, never holding output: engine messages that queued up while
earlier ones were processed are processed together, each request's outputs next to each other, so a
stream's reader gets one merged delta (one gRPC response, one SSE chunk) for several steps; a frontend
that keeps up gets every token alone, at once. Merged or not, what a client receives concatenates to
the same text, ids, logprobs, finish, stop reason and usage, byte for byte."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from tandem.engine.v1 import engine_core_pb2 as epb
from tandem.v1 import generation_pb2 as pb

from frontend_svc.delta_collector import DeltaCollector
from frontend_svc.dispatcher import OUTPUT_SLICE, Dispatcher
from frontend_svc.engines.client import READ_AHEAD, EngineClient, EngineConnection
from frontend_svc.grpc_api.servicer import prepare
from frontend_svc.grpc_api.wire import response_from_delta
from frontend_svc.openai.bodies import ChatBuilder, TokenTexts
from frontend_svc.output_processor import OutputProcessor
from frontend_svc.outputs import CompletionDelta
from frontend_svc.processor import Processor
from shared_runtime.contract import SamplingParams

TEXT = " the keeper climbed the stairs and the lamp turned over the grey water until dawn came"
STOP = "lamp turned"  # matched mid-passage: the frontend cuts the text and aborts the completion
STEPS = 8


class _Stream:
    """A `Connect` call's responses: all already received (an engine far ahead of the frontend), or
    each once `gate` is set (a frontend that keeps up)."""

    def __init__(self, messages: list[epb.EngineCoreOutputs], gate: asyncio.Event | None = None) -> None:
        self.messages, self.gate = messages, gate

    async def __aiter__(self) -> AsyncIterator[epb.EngineCoreOutputs]:
        for message in self.messages:
            if self.gate is not None:
                await self.gate.wait()
                self.gate.clear()
            yield message


def _setup(tokenizer: Any, encode: Callable[[str], list[int]], num_requests: int) -> tuple[
        EngineConnection, list[DeltaCollector], list[epb.EngineCoreOutputs], Processor]:
    """`num_requests` requests (the first with n=2, every other with a stop string, all with top-2
    logprobs) and the engine's `STEPS` messages for them, one step each; the last finishes them."""
    op = OutputProcessor(tokenizer)
    processor = Processor(tokenizer, max_model_len=256, vocab_size=tokenizer.vocab_size, model_name="tiny")
    client = EngineClient([], tokenizer.vocab_size)
    dispatcher = Dispatcher(client, op)
    connection = EngineConnection("fake", client)
    client.choose = lambda ids, **how: connection  # type: ignore[method-assign]
    words = encode(TEXT)
    per_step = len(words) // STEPS
    collectors, engine_ids = [], []
    for i in range(num_requests):
        params = SamplingParams(max_tokens=64, logprobs=2, n=2 if i == 0 else 1, stop=[STOP] if i % 2 else None)
        collector = DeltaCollector()
        prepared = processor.process("Mara walked", params, request_id=f"r{i}")
        dispatcher.submit(prepared, processor.engine_requests(prepared), collector)
        collector.gate = None  # ungated unless a test sets it
        collectors.append(collector)
        engine_ids.extend(prepared.engine_request_ids)
    messages = []
    for step in range(STEPS):
        ids = words[step * per_step:(step + 1) * per_step]
        message = epb.EngineCoreOutputs()
        for rid in engine_ids:
            out = message.outputs.add(request_id=rid, new_token_ids=ids)
            for token in ids:
                out.new_logprobs.add(token_id=token, logprob=-0.25, rank=1, top_token_ids=[token, token + 1],
                                     top_logprobs=[-0.25, -1.5])
            if step == STEPS - 1:
                out.finish_reason = epb.FINISH_REASON_LENGTH
        messages.append(message)
    return connection, collectors, messages, processor


async def _read_all(collectors: list[DeltaCollector], after_each: Callable[[], None] = lambda: None
                    ) -> list[list[list[CompletionDelta]]]:
    """What each request's reader gets, batch by batch, until all its completions finished."""
    async def reader(collector: DeltaCollector, n: int) -> list[list[CompletionDelta]]:
        batches, finished = [], 0
        while finished < n:
            batch = await collector.get()
            finished += sum(d.finished for d in batch)
            batches.append(batch)
            after_each()
        return batches
    return list(await asyncio.gather(*(reader(c, 2 if i == 0 else 1) for i, c in enumerate(collectors))))


def _run(tokenizer: Any, encode: Callable[[str], list[int]], *, kept_up: bool,
         num_requests: int) -> list[list[list[CompletionDelta]]]:
    async def main() -> list[list[list[CompletionDelta]]]:
        connection, collectors, messages, _ = _setup(tokenizer, encode, num_requests)
        gate = asyncio.Event() if kept_up else None
        if gate is not None:
            gate.set()
        pumping = asyncio.get_running_loop().create_task(connection._process_stream(_Stream(messages, gate)))
        read = await _read_all(collectors, gate.set if gate is not None else lambda: None)
        await pumping
        return read
    return asyncio.run(main())


class _PacedStream:
    """An engine a little ahead of the frontend: one message ready per turn of the event loop."""

    def __init__(self, messages: list[epb.EngineCoreOutputs]) -> None:
        self.messages = messages

    async def __aiter__(self) -> AsyncIterator[epb.EngineCoreOutputs]:
        for message in self.messages:
            await asyncio.sleep(0)
            yield message


def _batches_with_busy_readers(tokenizer: Any, encode: Callable[[str], list[int]], *, gated: bool) -> tuple[
        list[int], list[list[list[CompletionDelta]]]]:
    """How many engine messages each `on_outputs` call got, and what the readers got, when sending a
    response takes a reader `WRITE_TURNS` turns of the loop (a gRPC write completes through grpc's
    poller), with the connection's `DrainGate` on the collectors (as `Dispatcher.submit` sets it) or not."""
    async def main() -> tuple[list[int], list[list[list[CompletionDelta]]]]:
        connection, collectors, messages, _ = _setup(tokenizer, encode, 3)
        if gated:
            for collector in collectors:
                collector.gate = connection.gate
        sizes: list[int] = []
        process = connection._client.on_outputs

        async def counting(conn: EngineConnection, *batch: epb.EngineCoreOutputs) -> None:
            sizes.append(len(batch))
            await process(conn, *batch)

        connection._client.on_outputs = counting  # type: ignore[method-assign]
        pumping = asyncio.get_running_loop().create_task(connection._process_stream(_PacedStream(messages)))

        async def reader(collector: DeltaCollector, n: int) -> list[list[CompletionDelta]]:
            batches: list[list[CompletionDelta]] = []
            while sum(d.finished for batch in batches for d in batch) < n:
                batches.append(await collector.get())
                for _ in range(WRITE_TURNS):  # the write of the response
                    await asyncio.sleep(0)
            collector.release()
            return batches

        read = await asyncio.gather(*(reader(c, 2 if i == 0 else 1) for i, c in enumerate(collectors)))
        await pumping
        return sizes, list(read)
    return asyncio.run(main())


WRITE_TURNS = 4


def test_steps_that_arrive_while_the_readers_write_are_processed_together(tokenizer, encode) -> None:
    """The connection takes its next batch of engine messages once the readers it handed output to have
    sent it (`DrainGate`): the steps that arrived meanwhile are processed as one batch, so the frontend
    processes and each stream sends once per several steps. Without the gate every message is processed
    alone, as it arrives, and the readers' collectors merge what comes while they write."""
    sizes, read = _batches_with_busy_readers(tokenizer, encode, gated=True)
    ungated_sizes, ungated = _batches_with_busy_readers(tokenizer, encode, gated=False)
    assert sum(sizes) == sum(ungated_sizes) == STEPS
    assert ungated_sizes == [1] * STEPS
    assert len(sizes) <= STEPS // 2 and max(sizes) >= WRITE_TURNS - 1
    same = _by_completion(read), _by_completion(ungated)
    assert {k: _concat_responses([response_from_delta(d) for d in v]) for k, v in same[0].items()} == \
        {k: _concat_responses([response_from_delta(d) for d in v]) for k, v in same[1].items()}


def _by_completion(read: list[list[list[CompletionDelta]]]) -> dict[tuple[str, int], list[CompletionDelta]]:
    out: dict[tuple[str, int], list[CompletionDelta]] = {}
    for batches in read:
        for batch in batches:
            for delta in batch:
                out.setdefault((delta.request_id, delta.index), []).append(delta)
    return out


def test_a_frontend_behind_the_engine_merges_steps_per_request(tokenizer, encode) -> None:
    """Steps already received when the frontend gets to them are processed together, each request's
    outputs next to each other (a step here is larger than a slice, so the loop turns between slices
    and the readers run): every reader gets at most one delta per READ_AHEAD steps."""
    num_requests = OUTPUT_SLICE + 8
    read = _run(tokenizer, encode, kept_up=False, num_requests=num_requests)
    plain = read[2::2]  # no stop string, n = 1: STEPS steps each
    assert [len(batches) for batches in plain] == [-(-STEPS // READ_AHEAD)] * len(plain)


def test_a_frontend_that_keeps_up_sends_every_step_alone(tokenizer, encode) -> None:
    read = _run(tokenizer, encode, kept_up=True, num_requests=3)
    per_step = len(encode(TEXT)) // STEPS
    for batches in read[2:]:  # no stop string: one batch per step, one step's tokens in it
        assert len(batches) == STEPS
        assert all(len(d.token_ids) == per_step for batch in batches for d in batch)


def test_merged_and_step_by_step_output_are_the_same_bytes(tokenizer, encode) -> None:
    """gRPC responses and SSE chat chunks, with n=2, stop strings, logprobs and the finish."""
    num_requests = OUTPUT_SLICE + 8
    merged = _by_completion(_run(tokenizer, encode, kept_up=False, num_requests=num_requests))
    alone = _by_completion(_run(tokenizer, encode, kept_up=True, num_requests=num_requests))
    assert merged.keys() == alone.keys() and len(merged) == num_requests + 1
    assert sum(len(d) for d in merged.values()) < sum(len(d) for d in alone.values())
    stopped = 0
    for key in merged:
        grpc_merged = [response_from_delta(d) for d in merged[key]]
        grpc_alone = [response_from_delta(d) for d in alone[key]]
        assert _concat_responses(grpc_merged) == _concat_responses(grpc_alone), key
        assert "".join(r.text for r in grpc_alone).encode() == "".join(r.text for r in grpc_merged).encode()
        sse_merged, sse_alone = _sse(tokenizer, merged[key]), _sse(tokenizer, alone[key])
        assert _concat_chunks(sse_merged) == _concat_chunks(sse_alone), key
        stopped += grpc_alone[-1].stop_string == STOP
    assert stopped == num_requests // 2 and merged[("r1", 0)][-1].stop_reason == STOP


def _concat_responses(responses: list[Any]) -> tuple[Any, ...]:
    """What a gRPC client assembles: the text/ids/logprobs concatenated, the last response's end."""
    last = responses[-1]
    assert all(r.finish_reason == 0 for r in responses[:-1]) and last.finish_reason != 0
    return ("".join(r.text for r in responses), [t for r in responses for t in r.token_ids],
            [e.SerializeToString() for r in responses for e in r.logprobs], last.finish_reason,
            last.WhichOneof("stop_reason"), last.stop_string, last.usage.SerializeToString())


def _sse(tokenizer: Any, deltas: list[CompletionDelta]) -> list[dict[str, Any]]:
    builder = ChatBuilder("chatcmpl-1", "tiny", n=2, num_prompts=1, texts=TokenTexts(tokenizer), top_n=2)
    builder.created = 0
    return [json.loads(c) for c in (builder.chunk(0, d, True) for d in deltas) if c is not None]


def _concat_chunks(chunks: list[dict[str, Any]]) -> tuple[Any, ...]:
    """What an OpenAI client assembles from chat chunks: content and logprobs concatenated, the end."""
    choices = [c["choices"][0] for c in chunks]
    last = choices[-1]
    assert all(c["finish_reason"] is None for c in choices[:-1])
    return ("".join(c["delta"].get("content", "") for c in choices),
            [e for c in choices for e in (c["logprobs"] or {}).get("content", [])],
            last["finish_reason"], last.get("stop_reason"), last["index"], chunks[0]["id"])


# ---- through the frontend, with the fake engine: a slow consumer vs a fast one -------------------------


def test_a_slow_consumer_gets_merged_responses_and_a_fast_one_single_tokens(loop, tokenizer, tiny_model_dir) -> None:
    """The gRPC servicer's path (open_generation -> batches -> response_from_delta) against the fake
    engine in lockstep: a consumer that keeps up gets one token per response; one that is slow to take
    them gets fewer, larger responses that concatenate to the same bytes (n=2, a stop string, logprobs)."""
    from frontend_svc.client import generate_request
    from frontend_svc.config import FrontendConfig
    from frontend_svc.server import FrontendServer
    from tests.fake_engine import FakeEngine, start_fake_engine

    request = generate_request(TEXT, max_tokens=40, n=2, logprobs=2, stop=[STOP], seed=7)

    async def main() -> dict[bool, list[list[Any]]]:
        engine, port = await start_fake_engine(FakeEngine(vocab_size=tokenizer.vocab_size))
        frontend = FrontendServer(FrontendConfig(model=str(tiny_model_dir), engines=(f"127.0.0.1:{port}",),
                                                 host="127.0.0.1", port=0), tokenizer=tokenizer)
        await frontend.start()
        try:
            while not frontend.serving:
                await asyncio.sleep(0.01)
            return {slow: await _consume(frontend, request, slow) for slow in (False, True)}
        finally:
            await frontend.stop()
            await engine.stop(None)

    got = loop.run(main())
    fast, slow = got[False], got[True]
    assert all(len(r.token_ids) == 1 for responses in fast for r in responses)
    assert max(len(r.token_ids) for responses in slow for r in responses) > 1
    assert sum(map(len, slow)) < sum(map(len, fast))
    for index in (0, 1):
        assert _concat_responses(slow[index]) == _concat_responses(fast[index])
        assert slow[index][-1].stop_string == STOP


async def _consume(frontend: Any, request: Any, slow: bool) -> list[list[Any]]:
    """Each completion's responses, taking each batch at once or 30 ms late."""
    generation = frontend.open_generation(2, frontend.begin_call([], "Generate", {}))
    responses: list[list[Any]] = [[], []]
    try:
        await generation.start(lambda: prepare(frontend, request))
        gate = frontend.dispatcher.engine_of(generation._request).gate
        assert generation._collector.gate is gate  # the connection paces by this stream's reader too
        async for deltas in generation.batches():
            for delta in deltas:
                responses[delta.index].append(response_from_delta(delta))
            if slow:
                await asyncio.sleep(0.03)
    finally:
        generation.close()
    assert gate.outstanding == 0  # an ended stream is no reader for the engine stream to wait for
    return responses


def test_a_reader_that_never_comes_back_does_not_hold_back_the_others(loop, tokenizer, tiny_model_dir) -> None:
    """A stream whose reader took its first output and then stopped reading (a client that does not read)
    shares the engine stream with a victim: the victim streams to its end, in many responses, while
    the stalled stream's output waits merged in its collector, none of it lost."""
    from frontend_svc.client import generate_request
    from frontend_svc.config import FrontendConfig
    from frontend_svc.server import FrontendServer
    from tests.fake_engine import FakeEngine, start_fake_engine

    request = generate_request(TEXT, max_tokens=60, seed=7)

    async def main() -> tuple[list[Any], list[CompletionDelta], float]:
        engine, port = await start_fake_engine(FakeEngine(vocab_size=tokenizer.vocab_size, step_s=0.002))
        frontend = FrontendServer(FrontendConfig(model=str(tiny_model_dir), engines=(f"127.0.0.1:{port}",),
                                                 host="127.0.0.1", port=0), tokenizer=tokenizer)
        await frontend.start()
        stalled = frontend.open_generation(1, frontend.begin_call([], "Generate", {}))
        try:
            while not frontend.serving:
                await asyncio.sleep(0.01)
            await stalled.start(lambda: prepare(frontend, request))
            batches = stalled.batches()
            first = await anext(batches)  # ... and never again until the victim is done
            start = asyncio.get_running_loop().time()
            victim = await _consume_one(frontend, request)
            took = asyncio.get_running_loop().time() - start
            rest = [d for deltas in [first, *[b async for b in batches]] for d in deltas]
            return victim, rest, took
        finally:
            stalled.close()
            await frontend.stop()
            await engine.stop(None)

    victim, stalled, took = loop.run(main())
    assert len(victim) > 10 and victim[-1].finish_reason == pb.FINISH_REASON_LENGTH and took < 5.0
    assert len(stalled) == 2  # the first delta, then everything else merged into one
    assert sum(len(d.token_ids) for d in stalled) == sum(len(r.token_ids) for r in victim) == 60
    assert "".join(d.text for d in stalled) == "".join(r.text for r in victim)


async def _consume_one(frontend: Any, request: Any) -> list[Any]:
    generation = frontend.open_generation(1, frontend.begin_call([], "Generate", {}))
    try:
        await generation.start(lambda: prepare(frontend, request))
        return [response_from_delta(d) async for deltas in generation.batches() for d in deltas]
    finally:
        generation.close()
