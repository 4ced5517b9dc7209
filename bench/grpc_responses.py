"""CPU per gRPC `GenerateResponse` built from a `CompletionDelta` (frontend_svc/grpc_api/wire.py
`response_from_delta`) and serialised as grpc then does (`SerializeToString`), without logprobs and with
top-N, for deltas of several tokens (a frontend behind its engine merges steps). The gRPC twin of
bench/sse_chunks.py: what the servicer's per-message Python costs, apart from grpc's own write.

`--alternatives` also times other ways of filling the logprobs (each checked to give the same bytes):
the message constructors taking lists of messages, or of dicts, instead of an `add()` per entry and per
alternative. Run on a quiet machine (`/work/bin/quiet` on the shared box):

    python bench/grpc_responses.py [--top 5] [--tokens 1 4 12] [--number 20000] [--alternatives]
"""

from __future__ import annotations

import argparse
import sys
import timeit
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.v1 import generation_pb2 as pb

from frontend_svc.grpc_api.wire import response_from_delta
from frontend_svc.outputs import CompletionDelta, TokenLogprob


def _delta(top: int | None, tokens: int) -> CompletionDelta:
    logprobs = None if top is None else [
        TokenLogprob(token_id=5000 + t, logprob=-0.25 - 0.37 * t, rank=1 + t % 3,
                     top=[(5000 + t + 300 * i, -0.25 - 0.73 * i) for i in range(top)]) for t in range(tokens)]
    return CompletionDelta(request_id="0123456789abcdef0123456789abcdef", index=0, text=" the" * tokens,
                           token_ids=list(range(5000, 5000 + tokens)), logprobs=logprobs)


def _messages(delta: CompletionDelta) -> pb.GenerateResponse:
    """Logprobs as a list of TokenLogprobs messages, each built with its list of TopLogprob messages."""
    return pb.GenerateResponse(
        request_id=delta.request_id, index=delta.index, text=delta.text, token_ids=delta.token_ids,
        logprobs=[pb.TokenLogprobs(token_id=e.token_id, logprob=e.logprob, rank=e.rank, text=e.text,
                                   top_logprobs=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in e.top])
                  for e in delta.logprobs or []])


def _dicts(delta: CompletionDelta) -> pb.GenerateResponse:
    """Logprobs as a list of dicts (upb converts them in the constructor)."""
    return pb.GenerateResponse(
        request_id=delta.request_id, index=delta.index, text=delta.text, token_ids=delta.token_ids,
        logprobs=[{"token_id": e.token_id, "logprob": e.logprob, "rank": e.rank, "text": e.text,
                   "top_logprobs": [{"token_id": t, "logprob": lp} for t, lp in e.top]}
                  for e in delta.logprobs or []])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=5, help="top logprobs per token")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 12], help="tokens per delta")
    parser.add_argument("--number", type=int, default=20000, help="responses per measurement")
    parser.add_argument("--alternatives", action="store_true", help="also time other ways to fill logprobs")
    args = parser.parse_args()
    ways: list[tuple[str, Callable[[CompletionDelta], pb.GenerateResponse]]] = [("add()", response_from_delta)]
    if args.alternatives:
        ways += [("messages", _messages), ("dicts", _dicts)]
    for tokens in args.tokens:
        for top in (None, args.top):
            delta = _delta(top, tokens)
            want = response_from_delta(delta).SerializeToString()
            row = []
            for name, build in ways if top is not None else ways[:1]:
                if build(delta).SerializeToString() != want:
                    raise SystemExit(f"{name}: not the same bytes")
                seconds = min(timeit.repeat(lambda b=build, d=delta: b(d), number=args.number, repeat=3))
                row.append(f"{name} {seconds / args.number * 1e6:6.2f}")
            serialise = response_from_delta(delta).SerializeToString
            seconds = min(timeit.repeat(serialise, number=args.number, repeat=3))
            label = f"{tokens} tok/delta" + (f", top-{top}" if top is not None else "")
            print(f"{label:22s} build µs/response: {'  '.join(row)}   SerializeToString "
                  f"{seconds / args.number * 1e6:5.2f}")


if __name__ == "__main__":
    main()
