"""CPU per OpenAI stream chunk: the builders' chunks (frontend_svc/openai/bodies.py: plain dicts, a chat
chunk's logprobs joined from cached JSON; the "dicts" column) against the pydantic models they replaced
(the reference in tests/openai_api/test_chunk_bytes.py, same bytes).

One delta of `--tokens` tokens per chunk (a frontend behind its engine merges several), chat and
completions, without logprobs and with top-N; prints µs per chunk for both and their ratio. Run on a
quiet machine (`/work/bin/quiet` on the shared box):

    python bench/sse_chunks.py [--top 5] [--tokens 1] [--number 20000]
"""

from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from frontend_svc.openai import bodies
from frontend_svc.outputs import CompletionDelta, TokenLogprob
from tests.openai_api.test_chunk_bytes import PydanticChat, PydanticCompletion, Texts


def _delta(top: int | None, tokens: int) -> CompletionDelta:
    logprobs = None if top is None else [
        TokenLogprob(token_id=5 + t, logprob=-0.25 - 0.37 * t, rank=1,
                     top=[(5 + t + i, -0.25 - 0.73 * i) for i in range(top)], text=" the") for t in range(tokens)]
    return CompletionDelta(request_id="r", index=0, text=" the" * tokens, token_ids=list(range(5, 5 + tokens)),
                           logprobs=logprobs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=5, help="top logprobs of the logprobs rows")
    parser.add_argument("--tokens", type=int, default=1, help="tokens per delta (per chunk)")
    parser.add_argument("--number", type=int, default=20000, help="chunks per measurement")
    args = parser.parse_args()
    for name, new, old in [("chat", bodies.ChatBuilder, PydanticChat),
                           ("completions", bodies.CompletionBuilder, PydanticCompletion)]:
        for top in (None, args.top):
            times = []
            for cls in (old, new):
                builder = cls("id", "model", 1, 1, Texts(), top)
                builder.prompts = [bodies.PromptInfo("prompt", [1])]
                delta = _delta(top, args.tokens)
                seconds = timeit.timeit(lambda b=builder, d=delta: b.chunk(0, d, False), number=args.number)
                times.append(seconds / args.number * 1e6)
            label = f"{name}, top-{top} logprobs" if top is not None else name
            print(f"{label:28s} models {times[0]:6.1f} µs/chunk  dicts {times[1]:6.1f} µs/chunk  "
                  f"dicts/models {times[1] / times[0]:.2f}")


if __name__ == "__main__":
    main()
