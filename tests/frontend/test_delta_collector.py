"""DeltaCollector: a slow reader gets every completion's output merged, in bounded memory."""

from __future__ import annotations

import asyncio

import pytest

from frontend_svc.delta_collector import DeltaCollector, SinkBatch
from frontend_svc.engines.drain_gate import DrainGate
from frontend_svc.outputs import CompletionDelta, TokenLogprob, Usage
from frontend_svc.service_error import UNAVAILABLE, ServiceError


def delta(index: int, step: int, *, finish: str | None = None) -> CompletionDelta:
    d = CompletionDelta("client", index, f"<{index}.{step}>", [100 * index + step], f"engine-{index}",
                        logprobs=[TokenLogprob(100 * index + step, -float(step), 1)])
    if step == 0:
        d.prompt_logprobs = [TokenLogprob(7, -0.5, 1)]
    if finish is not None:
        d.finish_reason, d.stop_reason, d.usage = finish, "END", Usage(3, step + 1)
    return d


def test_a_slow_reader_gets_one_merged_delta_per_completion() -> None:
    collector = DeltaCollector()
    for step in range(200):  # nobody reads while 200 steps of 2 completions arrive
        collector.put(delta(0, step, finish="stop" if step == 199 else None))
        if step < 120:
            collector.put(delta(1, step))
        assert collector.num_pending <= 2  # memory stays bounded by n, not by the lag
    merged = asyncio.run(collector.get())
    assert [d.index for d in merged] == [0, 1]
    first, second = merged
    assert first.text == "".join(f"<0.{i}>" for i in range(200))
    assert first.token_ids == list(range(200))
    assert [lp.token_id for lp in first.logprobs or []] == list(range(200))
    assert first.prompt_logprobs is not None and first.prompt_logprobs[0].token_id == 7
    assert (first.finish_reason, first.stop_reason, first.usage) == ("stop", "END", Usage(3, 200))
    assert second.token_ids == list(range(100, 220)) and second.finish_reason is None
    assert collector.num_pending == 0


def test_a_failure_comes_after_the_output_already_pending() -> None:
    async def scenario() -> tuple[list[CompletionDelta], ServiceError]:
        collector = DeltaCollector()
        collector.put(delta(0, 0))
        collector.fail(ServiceError(UNAVAILABLE, "engine lost", "ENGINE_UNAVAILABLE"))
        collector.fail(ServiceError(UNAVAILABLE, "later failure", "DRAINING"))  # the first one wins
        pending = await collector.get()
        with pytest.raises(ServiceError) as info:
            await collector.get()
        return pending, info.value

    pending, error = asyncio.run(scenario())
    assert [d.text for d in pending] == ["<0.0>"]
    assert (error.code, error.message, error.reason) == (UNAVAILABLE, "engine lost", "ENGINE_UNAVAILABLE")


def test_get_waits_for_output() -> None:
    async def scenario() -> list[CompletionDelta]:
        collector = DeltaCollector()
        reader = asyncio.ensure_future(collector.get())
        await asyncio.sleep(0.01)
        assert not reader.done()
        collector.put(delta(0, 0))
        return await asyncio.wait_for(reader, 1.0)

    assert [d.text for d in asyncio.run(scenario())] == ["<0.0>"]


# ---- DrainGate: an engine stream paced by the readers it handed output to -------------------------------


def _gated(gate: DrainGate, count: int) -> list[DeltaCollector]:
    collectors = [DeltaCollector() for _ in range(count)]
    for collector in collectors:
        collector.gate = gate
    return collectors


async def _turns(count: int) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


def test_the_gate_opens_once_every_reader_handed_output_came_back_for_more() -> None:
    async def scenario() -> None:
        gate = DrainGate()
        first, second = _gated(gate, 2)
        first.put(delta(0, 0))
        second.put(delta(0, 0))
        second.put(delta(0, 1))  # merged into unread output: handed once
        drained = asyncio.ensure_future(gate.drained(timeout=10.0))
        taken = await first.get()  # taken, but not yet sent: the reader has not come back
        await _turns(5)
        assert [d.text for d in taken] == ["<0.0>"] and not drained.done()
        reading = asyncio.ensure_future(first.get())  # sent: back for more
        await _turns(5)
        assert not drained.done()  # the second reader has not even taken its output
        assert [d.text for d in await second.get()] == ["<0.0><0.1>"]
        second.release()  # the reader stops reading (its stream ended)
        await asyncio.wait_for(drained, 1.0)
        reading.cancel()

    asyncio.run(scenario())


def test_a_gate_with_nothing_handed_does_not_wait() -> None:
    async def scenario() -> None:
        gate = DrainGate()
        collector, = _gated(gate, 1)
        collector.put(delta(0, 0))
        await collector.get()
        reading = asyncio.ensure_future(collector.get())
        await asyncio.sleep(0)
        await asyncio.wait_for(gate.drained(timeout=10.0), 0.5)
        await asyncio.wait_for(gate.drained(timeout=10.0), 0.5)  # nothing handed since
        reading.cancel()

    asyncio.run(scenario())


def test_a_stalled_reader_holds_back_one_batch_at_most_the_wait_once() -> None:
    """A reader that never comes back delays the batch after its output by `timeout`, and no later one:
    output put into its unread collector is not handed again, and its late `taken` is for an epoch gone."""
    async def scenario() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        gate = DrainGate()
        stalled, live = _gated(gate, 2)
        stalled.put(delta(0, 0))
        start = loop.time()
        await gate.drained(timeout=0.05)
        held = loop.time() - start
        stalled.put(delta(0, 1))
        live.put(delta(0, 1))
        await live.get()
        reading = asyncio.ensure_future(live.get())
        start = loop.time()
        await asyncio.wait_for(gate.drained(timeout=10.0), 1.0)
        second = loop.time() - start
        assert [d.text for d in await stalled.get()] == ["<0.0><0.1>"]  # all of it, merged
        reading.cancel()
        return held, second

    held, second = asyncio.run(scenario())
    assert 0.04 <= held < 1.0
    assert second < 0.04


def test_a_parked_reader_is_not_woken_for_what_its_sink_writes() -> None:
    """The sink takes deltas only while the reader waits, once per batch (a batch's deltas of a completion
    merged): those never wake it; a delta it refuses does, and the deltas after it (the reader not yet
    back) wait, merged, unoffered; a finish wakes the reader at once, with what is pending."""
    async def scenario() -> tuple[list[str], list[list[str]], int]:
        collector, batch = DeltaCollector(), SinkBatch()
        collector.batch = batch
        written: list[str] = []
        accept = [True]

        def sink(d: CompletionDelta) -> bool:  # as Generation's: a finish goes to the reader
            assert d.finish_reason is None
            if not accept[0]:
                return False
            written.append(d.text)
            return True
        collector.sink = sink
        wakeups = 0
        got: list[list[str]] = []

        async def reader() -> None:
            nonlocal wakeups
            while True:
                deltas = await collector.get()
                wakeups += 1
                got.append([d.text for d in deltas])
                if any(d.finish_reason for d in deltas):
                    return
        task = asyncio.ensure_future(reader())
        await asyncio.sleep(0)  # the reader parks
        for step in range(0, 50, 2):  # 25 batches of two steps each
            collector.put(delta(0, step))
            collector.put(delta(0, step + 1))
            assert not written or written[-1] == f"<0.{step - 2}><0.{step - 1}>"  # nothing before the flush
            batch.flush()
            await asyncio.sleep(0)
        accept[0] = False  # e.g. the connection is over its high-water mark
        collector.put(delta(0, 50))
        batch.flush()
        collector.put(delta(0, 51))  # the reader has not run yet: merged, not offered
        accept[0] = True
        collector.put(delta(0, 52))
        batch.flush()
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # the reader took them and parked again
        collector.put(delta(0, 53))
        batch.flush()
        collector.put(delta(0, 54))
        collector.put(delta(0, 55, finish="stop"))  # no flush: a finish wakes the reader itself
        await asyncio.wait_for(task, 5)
        batch.flush()  # finds the reader gone from the sink's reach: nothing written
        return written, got, wakeups

    written, got, wakeups = asyncio.run(scenario())
    assert written == [f"<0.{i}><0.{i + 1}>" for i in range(0, 50, 2)] + ["<0.53>"]
    assert got == [["<0.50><0.51><0.52>"], ["<0.54><0.55>"]]
    assert wakeups == 2


def test_a_sink_that_raises_is_turned_off_and_its_error_raised_by_the_reader() -> None:
    async def scenario() -> tuple[BaseException, list[str]]:
        collector, batch = DeltaCollector(), SinkBatch()
        collector.batch = batch

        def sink(d: CompletionDelta) -> bool:
            raise ValueError("bad chunk")
        collector.sink = sink
        task = asyncio.ensure_future(collector.get())
        await asyncio.sleep(0)
        collector.put(delta(0, 0))
        batch.flush()
        with pytest.raises(ValueError) as info:
            await asyncio.wait_for(task, 5)
        collector.put(delta(0, 1))  # the sink is off: the delta waits for the reader
        return info.value, [d.text for d in await collector.get()]

    error, after = asyncio.run(scenario())
    assert str(error) == "bad chunk"
    assert after == ["<0.0><0.1>"]
