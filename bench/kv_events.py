"""The engine step's cost of KV-cache events: `EngineCore.step` with events on vs off, side by side.

Two engine cores on the same tiny model (the fastest forward, so that the scheduler's share of a step - and
so the events' - is as large as it gets), prefix caching on, a KV cache small enough to evict all the
time, the same seeded workload (requests sharing prefixes) run in alternating rounds on each. Each step is
followed by what the server's busy loop does, on both: the step's outputs go to the server's event loop
(another thread) with `call_soon_threadsafe`, where they are converted to protobuf as a Connect stream's
writer does. With events on, the busy loop's `KVEventHandOff` (after the step, or every 10 ms when steps
are shorter, and when idle) also moves the records there to a `KvEventPublisher` with `--subscribers`
subscriptions that serialize every batch as gRPC streams would. The event loop's thread shares the GIL
with the stepping one, so its work shows in the step time; its cost per batch (numbering, mirror,
protobuf, fan-out) is printed too.

Prints the median step time of each mode over the rounds, the on/off ratio, blocks stored and removed per
step, and the publisher's time per batch on the event loop.

    python bench/kv_events.py [--rounds 10] [--requests 64] [--subscribers 4] [--num-layers 2 --hidden-size 64]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make_workload(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, vocab) for _ in range(rng.randrange(32, 160))] for _ in range(8)]
    return [rng.choice(prefixes) + [rng.randrange(10, vocab) for _ in range(rng.randrange(8, 96))] for _ in range(n)]


class ServerLoop:
    """The server's side on its own event loop: step outputs converted as Connect writes them, and a
    KvEventPublisher whose subscribers serialize every batch as their gRPC streams would."""

    def __init__(self, block_size: int, subscribers: int) -> None:
        from engine_svc.api.kv_events import KvEventPublisher

        self.loop = asyncio.new_event_loop()
        self.publisher = KvEventPublisher("bench", block_size, buffer=1 << 20)
        self.publish_s = 0.0
        self.batches = 0
        self.received = 0
        ready = threading.Event()

        async def drain(stream: Any) -> None:
            async for batch in stream:
                batch.SerializeToString()
                self.received += 1

        def main() -> None:
            asyncio.set_event_loop(self.loop)
            for _ in range(subscribers):
                self.loop.create_task(drain(self.publisher.subscribe().batches()))
            self.loop.call_soon(ready.set)
            self.loop.run_forever()

        threading.Thread(target=main, daemon=True).start()
        ready.wait()

    def deliver(self, outputs: Any) -> None:  # runs on the loop thread, for every step
        from shared_runtime.to_pb import outputs_to_pb

        outputs_to_pb(outputs).SerializeToString()

    def publish(self, events: list[Any], stats: Any) -> None:  # runs on the loop thread
        t = time.perf_counter()
        self.publisher.publish(events, stats)
        self.publish_s += time.perf_counter() - t
        self.batches += 1


def run_round(core: Any, prompts: list[list[int]], tag: str, server: ServerLoop,
              hand_off: Any) -> tuple[float, int]:
    """Run every prompt to completion, as the busy loop steps; (seconds in step + hand-off, steps)."""
    from shared_runtime.contract import EngineCoreRequest, EngineSamplingParams

    for i, prompt in enumerate(prompts):
        core.add_request(EngineCoreRequest(request_id=f"{tag}-{i}", prompt_token_ids=prompt,
                                           sampling_params=EngineSamplingParams(temperature=0.0, max_tokens=24,
                                                                                ignore_eos=True)))
    steps = 0
    elapsed = 0.0
    while core.has_unfinished_requests():
        t = time.perf_counter()
        outputs = core.step()
        server.loop.call_soon_threadsafe(server.deliver, outputs)  # what BusyLoop does after every iteration
        if hand_off is not None:
            hand_off(outputs.scheduler_stats, idle=not core.has_unfinished_requests())
        elapsed += time.perf_counter() - t
        steps += 1
    return elapsed, steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--subscribers", type=int, default=4)
    ap.add_argument("--num-blocks", type=int, default=128, help="KV blocks (small: the cache evicts all the time)")
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch

    from engine_svc.config import EngineConfig
    from engine_svc.core import EngineCore
    from engine_svc.kv.events import KVEventHandOff
    from entrypoints.tiny_model import make_tiny_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "model", seed=args.seed, vocab_size=1024, num_layers=args.num_layers,
                                    hidden_size=args.hidden_size, num_heads=max(1, args.hidden_size // 16),
                                    num_kv_heads=max(1, args.hidden_size // 32))
        config = EngineConfig.create(model=str(model_dir), dtype="float32", device="cpu", max_num_seqs=16,
                                     block_size=16, num_gpu_blocks_override=args.num_blocks,
                                     max_num_batched_tokens=512)
        cores = {"off": EngineCore(config), "on": EngineCore(config, kv_events=True)}
        servers = {mode: ServerLoop(config.block_size, args.subscribers) for mode in cores}
        publisher = servers["on"]

        def sink(events: list[Any], stats: Any) -> None:
            counted["events"] += len(events)
            publisher.loop.call_soon_threadsafe(publisher.publish, events, stats)

        hand_offs = {"off": None, "on": KVEventHandOff(cores["on"].kv_events, sink)}
        counted = {"steps": 0, "events": 0}
        prompts = make_workload(args.requests, 1000, args.seed)
        for mode, core in cores.items():  # warm-up
            run_round(core, prompts[:4], f"warm-{mode}", servers[mode], hand_offs[mode])
        counted["events"] = 0
        times: dict[str, list[float]] = {"off": [], "on": []}
        for r in range(args.rounds):
            for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                elapsed, steps = run_round(cores[mode], prompts, f"{mode}-{r}", servers[mode], hand_offs[mode])
                times[mode].append(elapsed / steps)
                counted["steps"] += steps if mode == "on" else 0
        time.sleep(0.5)  # the publisher's loop drains the last batches
        off, on = statistics.median(times["off"]), statistics.median(times["on"])
        print(f"tiny Llama ({args.num_layers}L x {args.hidden_size}) on CPU, {args.requests} requests x 24 tokens over shared prefixes, "
              f"{args.num_blocks} KV blocks of 16, {args.rounds} alternating rounds per mode")
        print(f"step, events off: {1e3 * off:.3f} ms (rounds: {', '.join(f'{1e3 * t:.3f}' for t in times['off'])})")
        print(f"step, events on:  {1e3 * on:.3f} ms (rounds: {', '.join(f'{1e3 * t:.3f}' for t in times['on'])})")
        print(f"on / off: {on / off:.3f}x; {counted['events'] / counted['steps']:.1f} block events per step, "
              f"{counted['steps'] / max(1, publisher.batches):.1f} steps per batch")
        print(f"publisher on the event loop: {1e6 * publisher.publish_s / max(1, publisher.batches):.0f} us per batch "
              f"({publisher.batches} batches, {args.subscribers} subscribers, "
              f"{publisher.received} subscriber messages; dropped {publisher.publisher.counters.dropped_subscribers})")
        for core in cores.values():
            core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
