"""EngineClient.on_outputs: a large engine step is processed in slices with the event loop free between them,
in engine order, and every output still reaches its request."""

from __future__ import annotations

import asyncio
import itertools

from frontend_svc.engine_client import OUTPUT_SLICE, EngineClient
from frontend_svc.output_processor import OutputProcessor
from frontend_svc.processor import Processor
from frontend_svc.request_state import DeltaCollector
from shared_runtime import contract as p
from shared_runtime.contract import SamplingParams
from shared_runtime.to_pb import outputs_to_pb

NUM_REQUESTS = 256


def test_a_256_request_step_leaves_the_loop_free_between_slices(tokenizer, encode) -> None:
    op = OutputProcessor(tokenizer)
    processor = Processor(tokenizer, max_model_len=256, vocab_size=tokenizer.vocab_size, model_name="tiny")
    client = EngineClient([], op, tokenizer.vocab_size)
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
        await client.on_outputs(None, message)  # type: ignore[arg-type]  # no stats, aborts or finishes
        watcher.cancel()
        return seen

    seen = asyncio.run(run())
    partial = [n for n in seen if 0 < n < NUM_REQUESTS]
    assert partial, "the whole step was processed without yielding the event loop"
    assert max(b - a for a, b in itertools.pairwise(seen)) <= OUTPUT_SLICE
    assert partial == sorted(partial)  # slices in engine order
    assert all(c.num_pending == 1 for c in collectors)
    assert all("".join(d.text for d in asyncio.run(c.get())) == " boats" for c in collectors)
