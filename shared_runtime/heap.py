"""The cyclic garbage collector's settings for a serving process, applied once it has started.

A serving process allocates short-lived containers on every token (deltas, logprob rows, protobuf
wrappers); reference counting frees nearly all of them, but CPython's collector still runs a young
collection every 700 net container allocations and, every so often, a full one over every tracked
object — the tokenizer's tables, the chat templates, the imported libraries: a pause for every stream
(BENCHMARKS.md, "An engine stream paced by its readers, and a settled heap"). `settle_heap()` moves what start-up built out of the collector's reach
(`gc.freeze`: a full collection then scans only what was allocated since) and collects the young
generation every `GEN0_THRESHOLD` allocations, so a serving process spends its collector time in
proportion to the garbage cycles it makes, which are few, not to its request rate. Cycles are still
collected; between two young collections at most `GEN0_THRESHOLD` objects wait (a few MB at most).
"""

from __future__ import annotations

import gc

GEN0_THRESHOLD = 50_000  # net container allocations between two young collections (CPython's default: 700)


def settle_heap() -> None:
    """Collect and freeze everything allocated so far, then space young collections `GEN0_THRESHOLD`
    apart (the older generations keep their default ratios). Call once, after start-up."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)
