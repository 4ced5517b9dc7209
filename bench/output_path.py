"""CPU per token of the frontend's per-token path alone: engine messages -> `CompletionDelta`s in the
requests' `DeltaCollector`s, through `Dispatcher.on_outputs` (slicing, `OutputProcessor.process`,
delivery), with no gRPC and no API layer. (A tree from before the dispatcher, `--root` of an older
checkout, is measured through its `EngineClient.on_outputs`, the same path.)

SmolLM2-135M-Instruct's tokenizer (the demo GGUF); 128 requests added with collectors; every step is one
`EngineCoreOutputs` with one token per request (the fake engine's shape, tests/fake_engine.py: the
passage of bench/frontend_capacity.py, top-N rows of consecutive ids), parsed from its wire bytes as the
frontend gets it; after each step every collector is read (a reader that keeps up). Cases: plain, 4 stop
strings (never matching), top-5 logprobs, both; `--stream-interval N` holds each completion's deltas to
N tokens as the server's flag does; `--read-every N` has the readers take their output every N steps
(readers that are behind, as at capacity: their deltas merge). Prints µs per token (median and best of `--rounds`).

Compare two trees in one run on a quiet machine (`/work/bin/quiet` on the shared box):

    python bench/output_path.py --root /tmp/base_tree --root .   # [--tokens 256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
CASES = ("plain", "stop", "logprobs", "stop+logprobs")


def measure(case: str, streams: int, tokens: int, rounds: int, interval: int = 1, read_every: int = 1) -> list[float]:
    """µs per token of each round (run inside the tree under test: its modules are imported)."""
    sys.path[:0] = [str(Path.cwd()), str(Path.cwd() / "bench")]  # the tree under test (cwd), not this file's
    from frontend_capacity import PASSAGE, QUESTION, STOP_STRINGS, TOP_LOGPROBS  # type: ignore[import-not-found]
    from tandem.engine.v1 import engine_core_pb2 as epb

    import frontend_svc
    from entrypoints.demo_model import demo_gguf_path
    from frontend_svc.engines.client import EngineClient
    from frontend_svc.output_processor import OutputProcessor
    from frontend_svc.processor import Processor
    from frontend_svc.tokenizer import Tokenizer
    try:
        from frontend_svc.delta_collector import DeltaCollector
        from frontend_svc.dispatcher import Dispatcher
    except ImportError:  # a tree from before the dispatcher
        from frontend_svc.request_state import DeltaCollector  # type: ignore[import-not-found,no-redef]
        Dispatcher = None
    from shared_runtime.contract import SamplingParams

    assert Path(frontend_svc.__file__).resolve().is_relative_to(Path.cwd().resolve()), "not the tree of --root"

    tokenizer = Tokenizer.from_pretrained(demo_gguf_path())
    passage = tokenizer.encode(PASSAGE, add_special_tokens=False)
    vocab = tokenizer.vocab_size
    processor = Processor(tokenizer, max_model_len=8192, vocab_size=vocab, model_name="bench")
    top = TOP_LOGPROBS if "logprobs" in case else None
    params = SamplingParams(max_tokens=tokens, stop=STOP_STRINGS if "stop" in case else [], logprobs=top)

    class Connection:  # what on_outputs/_deliver use of an EngineConnection
        retiring = False

        def __init__(self) -> None:
            self.requests: set[Any] = set()

        def note_stats(self, stats: Any) -> None:
            pass

        def note_sent(self, count: int) -> None:
            pass

        gate = None

        def send(self, message: Any) -> None:
            raise AssertionError("no stop string matches the passage")

    def messages(engine_ids: list[str]) -> list[Any]:
        out = []
        for position in range(tokens):
            message = epb.EngineCoreOutputs()
            token = passage[position % len(passage)]
            for rid in engine_ids:
                output = message.outputs.add(request_id=rid, new_token_ids=[token])
                if top is not None:
                    output.new_logprobs.add(token_id=token, logprob=-0.5, rank=1,
                                            top_token_ids=[(token + k) % vocab for k in range(top)],
                                            top_logprobs=[-0.5 - k for k in range(top)])
                if position == tokens - 1:
                    output.finish_reason = epb.FINISH_REASON_LENGTH
            out.append(epb.EngineCoreOutputs.FromString(message.SerializeToString()))
        return out

    async def one_round() -> float:
        op = OutputProcessor(tokenizer, stream_interval=interval)
        connection = Connection()
        if Dispatcher is not None:
            client = EngineClient([], vocab)
            client.choose = lambda ids: connection  # type: ignore[method-assign,assignment,return-value]
            dispatcher = Dispatcher(client, op)
            on_outputs = dispatcher.on_outputs
        else:
            client = EngineClient([], op, vocab)  # type: ignore[arg-type,call-arg]
            on_outputs = client.on_outputs
        collectors, engine_ids = [], []
        for i in range(streams):
            collector = DeltaCollector()
            prepared = processor.process(QUESTION, params, request_id=f"r{i}")
            if Dispatcher is not None:
                state = dispatcher.submit(prepared, [], collector)
                collector.gate = None
            else:
                state = op.add_request(prepared, collector)
                state.connection = connection
                connection.requests.add(state)
            collectors.append(collector)
            engine_ids.extend(state.prepared.engine_request_ids)
        steps = messages(engine_ids)
        start = time.perf_counter()
        for step, message in enumerate(steps, 1):
            await on_outputs(connection, message)  # type: ignore[arg-type]
            if step % read_every and step < len(steps):
                continue  # readers behind: they take several steps' output at once
            for collector in collectors:
                if collector.num_pending:  # (a stream interval holds some back)
                    await collector.get()
        elapsed = time.perf_counter() - start
        assert not connection.requests, "every request finished"
        return elapsed / (streams * tokens) * 1e6

    return [asyncio.run(one_round()) for _ in range(rounds)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", action="append", help="a tree to measure (repeat to compare; default: this one)")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per request")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--stream-interval", type=int, default=1, help="the server's (vLLM's --stream-interval)")
    parser.add_argument("--read-every", type=int, default=1,
                        help="the readers take their output after every N steps (N > 1: readers behind)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # a case, measured in this process
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.streams, args.tokens, args.rounds, args.stream_interval,
                                 args.read_every)))
        return
    roots = [Path(r).resolve() for r in (args.root or [HERE.parents[1]])]
    print(f"{args.streams} requests x {args.tokens} tokens, stream interval {args.stream_interval}, "
          f"readers take output every {args.read_every} steps, "
          f"µs per token: median (best) of {args.rounds} rounds")
    for case in args.cases:
        medians = []
        for root in roots:  # each tree in its own process, its own modules
            env = {**os.environ, "PYTHONPATH": str(root)}
            child = [sys.executable, str(HERE), "--child", case, "--streams", str(args.streams),
                     "--tokens", str(args.tokens), "--rounds", str(args.rounds),
                     "--stream-interval", str(args.stream_interval), "--read-every", str(args.read_every)]
            rounds = json.loads(subprocess.run(child, cwd=root, env=env, check=True, capture_output=True,
                                               text=True).stdout.strip().splitlines()[-1])
            medians.append(statistics.median(rounds))
            print(f"  {case:14s} {root!s:28s} {medians[-1]:6.2f} ({min(rounds):.2f})", flush=True)
        if len(medians) > 1:
            print(f"  {case:14s} {'last / first':28s} {medians[-1] / medians[0]:6.2f}")


if __name__ == "__main__":
    main()
