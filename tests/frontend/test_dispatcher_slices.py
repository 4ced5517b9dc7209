"""Dispatcher.on_outputs: a large engine step is processed in slices with the event loop free between them,
in engine order, and every output still reaches its request."""

from __future__ import annotations

import asyncio
import itertools

from tandem.engine.v1 import engine_core_pb2 as epb

from frontend_svc.delta_collector import DeltaCollector
from frontend_svc.dispatcher import OUTPUT_SLICE, Dispatcher, _slices
from frontend_svc.engines.client import EngineClient
from frontend_svc.output_processor import OutputProcessor
from frontend_svc.processor import Processor
from shared_runtime import contract as p
from shared_runtime.contract import SamplingParams
from shared_runtime.to_pb import outputs_to_pb

NUM_REQUESTS = 256


def test_a_256_request_step_leaves_the_loop_free_between_slices(tokenizer, encode) -> None:
    op = OutputProcessor(tokenizer)
    processor = Processor(tokenizer, max_model_len=256, vocab_size=tokenizer.vocab_size, model_name="tiny")
    dispatcher = Dispatcher(EngineClient([], tokenizer.vocab_size), op)
    collectors = [DeltaCollector() for _ in range(NUM_REQUESTS)]
    engine_ids = []
    for i, collector in enumerate(collectors):
        prepared = processor.process("Mara walked", SamplingParams(max_tokens=50), request_id=f"r{i}")
        op.add_request(prepared, collector)
        engine_ids.append(prepared.engine_request_ids[0])
    word = encode(" boats")
    message = outputs_to_pb(p.EngineCoreOutputs(
        outputs=[p.EngineCoreOutput(request_id=rid, new_token_ids=word) for rid in engine_ids]))

    async def run() -> list[int]:
        seen: list[int] = []  # requests with output, each time another task got the loop

        async def watch() -> None:
            while True:
                seen.append(sum(c.num_pending > 0 for c in collectors))
                await asyncio.sleep(0)

        watcher = asyncio.get_running_loop().create_task(watch())
        await asyncio.sleep(0)
        await dispatcher.on_outputs(None, message)  # type: ignore[arg-type]  # no stats, aborts or finishes
        watcher.cancel()
        return seen

    seen = asyncio.run(run())
    partial = [n for n in seen if 0 < n < NUM_REQUESTS]
    assert partial, "the whole step was processed without yielding the event loop"
    assert max(b - a for a, b in itertools.pairwise(seen)) <= OUTPUT_SLICE
    assert partial == sorted(partial)  # slices in engine order
    assert all(c.num_pending == 1 for c in collectors)
    assert all("".join(d.text for d in asyncio.run(c.get())) == " boats" for c in collectors)


def _message(*request_ids: str) -> epb.EngineCoreOutputs:
    return outputs_to_pb(p.EngineCoreOutputs(
        outputs=[p.EngineCoreOutput(request_id=rid, new_token_ids=[i]) for i, rid in enumerate(request_ids)]))


def _shape(slices: list[list[tuple[str, epb.EngineCoreOutput]]]) -> list[list[tuple[str, int]]]:
    """Each slice as (request id, the output's token), the id checked against the output's own."""
    assert all(rid == output.request_id for chunk in slices for rid, output in chunk)
    return [[(rid, output.new_token_ids[0]) for rid, output in chunk] for chunk in slices]


def test_one_message_with_several_steps_of_a_request_is_grouped_by_request() -> None:
    """engine_svc/api/output_packing.py puts several queued steps in one message: a request's outputs still go
    through the output processor next to each other (one merged delta), requests in first-seen order."""
    slices = list(_slices([_message("a", "b", "a", "c", "b")]))
    assert _shape(slices) == [[("a", 0), ("a", 2), ("b", 1), ("b", 4), ("c", 3)]]
    across = list(_slices([_message("a", "b"), _message("b", "a")]))
    assert _shape(across) == [[("a", 0), ("a", 1), ("b", 1), ("b", 0)]]


def test_distinct_requests_are_sliced_in_engine_order() -> None:
    ids = [f"r{i}" for i in range(2 * OUTPUT_SLICE + 3)]
    shape = _shape(list(_slices([_message(*ids)])))
    assert [len(chunk) for chunk in shape] == [OUTPUT_SLICE, OUTPUT_SLICE, 3]
    assert [rid for chunk in shape for rid, _ in chunk] == ids
    assert list(_slices([epb.EngineCoreOutputs()])) == [[]]  # an empty message is still delivered (stats)
