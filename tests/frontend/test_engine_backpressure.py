"""An engine ahead of the frontend is held back by gRPC flow control and packs its steps.

The frontend's engine channel keeps HTTP/2's 64 KiB stream window (no BDP probing), so while the
frontend's event loop is busy the engine's writes block after a few messages and the steps it makes
meanwhile go out together in its next message (engine_svc/api/server.py and the clocked fake engine both
pack what queued). With BDP probing the window grows to megabytes and every step arrives alone, to be
read back one message per event-loop turn: the frontend never catches up in large bites.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from tandem.engine.v1 import engine_core_pb2 as epb

from frontend_svc.delta_collector import DeltaCollector
from frontend_svc.dispatcher import Dispatcher
from frontend_svc.engines.client import EngineClient, EngineConnection
from frontend_svc.output_processor import OutputProcessor
from frontend_svc.processor import Processor
from shared_runtime.contract import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
STEP_S = 0.002
STALL_S = 0.5  # the frontend's loop blocked: ~250 engine steps made meanwhile
REQUESTS = 32
# One clocked fake engine in its own process (its clock must keep running while the test's loop stalls).
ENGINE = """
import asyncio, sys
from tests.fake_engine import FakeEngine, start_fake_engine

async def main():
    fake = FakeEngine(int(sys.argv[1]), step_s=float(sys.argv[2]), default_max_tokens=None,
                      output_ids=[5, 6, 7, 8], clocked=True)
    server, port = await start_fake_engine(fake)
    print(port, flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


def test_an_engine_ahead_of_a_stalled_frontend_packs_its_steps(tokenizer) -> None:
    engine = subprocess.Popen([sys.executable, "-c", ENGINE, str(tokenizer.vocab_size), str(STEP_S)],
                              stdout=subprocess.PIPE, cwd=ROOT, text=True)
    try:
        port = int(engine.stdout.readline())  # type: ignore[union-attr]
        steps_per_message = asyncio.run(_stall_and_count(tokenizer, port))
    finally:
        engine.kill()
        engine.wait()
    # Without back-pressure every step after the stall comes alone (the biggest message holds 1-2 steps).
    assert max(steps_per_message) >= 20, steps_per_message


async def _stall_and_count(tokenizer: Any, port: int) -> list[int]:
    """Steps per engine message the frontend processed (each message's most outputs of one request),
    for requests that run through a stall of the frontend's loop."""
    processor = Processor(tokenizer, max_model_len=4096, vocab_size=tokenizer.vocab_size, model_name="tiny")
    client = EngineClient([f"127.0.0.1:{port}"], tokenizer.vocab_size)
    dispatcher = Dispatcher(client, OutputProcessor(tokenizer))
    counted: list[int] = []
    on_outputs = client.on_outputs

    async def counting(connection: EngineConnection, *messages: epb.EngineCoreOutputs) -> None:
        for message in messages:
            counted.append(max(Counter(o.request_id for o in message.outputs).values(), default=0))
        await on_outputs(connection, *messages)

    client.on_outputs = counting  # type: ignore[method-assign]
    await client.start()
    try:
        while not client.ready_engines():
            await asyncio.sleep(0.01)
        collectors = []
        for i in range(REQUESTS):
            prepared = processor.process("Mara walked", SamplingParams(max_tokens=2000, logprobs=5),
                                         request_id=f"r{i}")
            collectors.append(DeltaCollector())
            dispatcher.submit(prepared, processor.engine_requests(prepared), collectors[-1])
        await collectors[-1].get()
        await asyncio.sleep(0.2)  # streaming, the frontend keeping up
        counted.clear()
        time.sleep(STALL_S)  # the frontend's loop busy: the engine keeps stepping
        await asyncio.sleep(0.3)  # catching up
        return list(counted)
    finally:
        await client.close()
