"""What the frontend pays per engine output for each shape it could consume (the choice recorded in
shared_runtime/contract.py's docstring).

One step of N one-token outputs plus scheduler stats is converted to protobuf (shared_runtime/to_pb.py),
serialized, and parsed again for every round, as the frontend receives it. Then, per output:

    read pb directly     the fields the output processor reads, off the parsed protobuf (what it does)
    pb -> structs, read  shared_runtime/from_pb.py's conversion to the contract structs first, then the same reads

    python bench/output_shapes.py [--outputs 64] [--rounds 3000]

Prints microseconds per output (best of 5 repeats; the machine is noisy) and the ratio.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from tandem.engine.v1 import engine_core_pb2 as pb

from shared_runtime import contract as c
from shared_runtime.from_pb import outputs_from_pb
from shared_runtime.to_pb import outputs_to_pb


def read_pb(msg: pb.EngineCoreOutputs) -> None:
    for o in msg.outputs:
        _ = (o.request_id, list(o.new_token_ids), o.num_cached_tokens, o.finish_reason, o.HasField("error"),
             o.new_logprobs, o.prompt_logprobs, o.events)


def read_structs(msg: pb.EngineCoreOutputs) -> None:
    for o in outputs_from_pb(msg).outputs:
        _ = (o.request_id, list(o.new_token_ids), o.num_cached_tokens, o.finish_reason, o.error,
             o.new_logprobs, o.prompt_logprobs, o.events)


def per_output_us(fn: Callable[[pb.EngineCoreOutputs], None], data: bytes, num_outputs: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(5):
        messages = [pb.EngineCoreOutputs.FromString(data) for _ in range(rounds)]  # fresh, as received
        start = time.perf_counter()
        for message in messages:
            fn(message)
        best = min(best, (time.perf_counter() - start) / rounds / num_outputs * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outputs", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3000)
    args = parser.parse_args()
    step = c.EngineCoreOutputs(
        outputs=[c.EngineCoreOutput(request_id=f"req-{i}-0-abcdef12{i:x}", new_token_ids=[1000 + i])
                 for i in range(args.outputs)],
        scheduler_stats=c.SchedulerStats(num_running=args.outputs, kv_cache_usage=0.5), timestamp=time.time())
    data = outputs_to_pb(step).SerializeToString()
    direct = per_output_us(read_pb, data, args.outputs, args.rounds)
    structs = per_output_us(read_structs, data, args.outputs, args.rounds)
    print(f"read pb directly:     {direct:.2f} us/output")
    print(f"pb -> structs, read:  {structs:.2f} us/output  (+{structs - direct:.2f} us/output, x{structs / direct:.1f})")


if __name__ == "__main__":
    main()
